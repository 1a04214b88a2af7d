"""A relaunch on a folder with a checkpoint: changes that make the checkpoint unusable are refused before
anything is written, legal ones are named, checkpoint.fresh_start sets the earlier run aside."""

import hashlib
import json

import pytest
from conftest import ON_HF, TINY, metric_lines, torchrun

ARGS = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--training.steps", "2"]


def folder_hashes(folder) -> dict[str, str]:
    """Every file of a dump folder and its SHA-256, but the lock file (which names the last job that held it)."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != ".lock"}


def error_lines(err: str) -> list[str]:
    """The lines of the run's error, from the one starting with 'error:' on."""
    lines = err.strip().splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("error: ")):]


@pytest.fixture
def trained(tmp_path, train_in_process, capsys):
    """A dump folder holding the checkpoint of a 2-step run."""
    dump = tmp_path / "run"
    assert train_in_process([*ARGS, "--job.dump_folder", str(dump)]) == 0
    capsys.readouterr()
    return dump


def test_a_shape_change_is_refused_in_a_few_lines_and_the_folder_is_unchanged(trained, train_in_process, capsys):
    before = folder_hashes(trained)
    assert {"config.toml", "metrics.jsonl", "checkpoint/step-2/run.json"} <= set(before)
    assert train_in_process([*ARGS, "--model.n_layers", "3", "--model.dim", "128",
                             "--job.dump_folder", str(trained)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) <= 15, lines
    assert lines[0].startswith(f"error: checkpoint {trained / 'checkpoint' / 'step-2'} does not fit this model: ")
    assert "  model.n_layers 2 → 3" in lines and "  model.dim unset → 128" in lines
    assert "--job.dump_folder" in lines[-1] and "--checkpoint.fresh_start true" in lines[-1]
    assert folder_hashes(trained) == before


def test_a_change_of_dataset_kind_is_refused_the_same_way(trained, train_in_process, capsys):
    before = folder_hashes(trained)
    hf_args = [*ARGS, *ON_HF, "--training.dataloader_workers", "0", "--job.dump_folder", str(trained)]
    assert train_in_process(hf_args) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) <= 15 and "Traceback" not in "\n".join(lines)
    assert ("  training.dataset packed → hf: the checkpoint's dataloader state does not fit the new one "
            "(or resume without it: --checkpoint.exclude_from_loading dataloader)") in lines
    assert folder_hashes(trained) == before
    # Leaving the data loader's state out makes the change legal: it resumes and names it.
    assert train_in_process([*hf_args, "--training.steps", "3", "--checkpoint.exclude_from_loading",
                             "dataloader"]) == 0
    [named] = [line for line in capsys.readouterr().err.splitlines() if "resuming step 2 with changes" in line]
    assert "training.dataset packed → hf" in named


def test_a_checkpoint_without_a_run_record_still_fails_in_words(trained, train_in_process, capsys):
    """A checkpoint written before run records: DCP's missing key becomes a clear message at load."""
    step = trained / "checkpoint" / "step-2"
    (step / "run.json").unlink()
    record = json.loads((step / "integrity.json").read_text())
    del record["files"]["run.json"]
    (step / "integrity.json").write_text(json.dumps(record))
    before = folder_hashes(trained)
    assert train_in_process([*ARGS, "--optimizer.name", "Muon", "--job.dump_folder", str(trained)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"error: {step} does not fit this run's optimizer state: it has no ")
    assert lines[0].endswith("Resume without it with --checkpoint.exclude_from_loading optimizer, or start anew: "
                             "a new --job.dump_folder, or --checkpoint.fresh_start true")
    assert train_in_process([*ARGS, "--training.spike_window", "32", "--job.dump_folder", str(trained)]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert (f"error: {step} does not fit this run's step_guard state: its step_guard.window has shape "
            "torch.Size([2, 128]), this run's torch.Size([2, 32])") in line
    assert folder_hashes(trained) == before


def test_a_global_batch_change_resumes_and_is_named_and_each_launch_config_is_kept(trained, train_in_process, capsys):
    assert train_in_process([*ARGS, "--training.local_batch_size", "8", "--training.steps", "4",
                             "--optimizer.lr", "1e-3", "--job.dump_folder", str(trained)]) == 0
    err = capsys.readouterr().err
    assert ("resuming step 2 with changes since it was saved: global batch 4 → 8, optimizer.lr 0.002 → 0.001, "
            "training.steps 2 → 4, training.local_batch_size 4 → 8") in err
    launches = sorted((trained / "configs").iterdir())
    assert [path.name[:11] for path in launches] == ["launch-0001", "launch-0002"]
    assert "training from step 1\n" in launches[0].read_text()
    assert "training from step 3\n" in launches[1].read_text()
    assert (trained / "config.toml").read_text() == launches[1].read_text()


@pytest.mark.slow
def test_two_processes_resuming_a_one_process_checkpoint_name_the_doubled_batch(trained):
    result = torchrun(2, [*ARGS, "--training.steps", "3", "--job.dump_folder", str(trained)])
    assert ("resuming step 2 with changes since it was saved: global batch 4 → 8, layout dp_shard 1 → 2 "
            "(1 → 2 processes), training.steps 2 → 3") in result.stderr


def test_initial_load_path_with_a_checkpoint_in_the_folder_says_which_wins(trained, train_in_process, capsys):
    assert train_in_process([*ARGS, "--training.steps", "3", "--checkpoint.initial_load_path", "elsewhere/step-9",
                             "--job.dump_folder", str(trained)]) == 0
    assert (f"checkpoint.initial_load_path elsewhere/step-9 is not loaded: this folder's own checkpoint "
            f"{trained / 'checkpoint' / 'step-2'} wins") in capsys.readouterr().err


def test_fresh_start_sets_the_earlier_run_aside_and_a_relaunch_resumes_it(trained, train_in_process, capsys):
    earlier = folder_hashes(trained)
    fresh = [*ARGS, "--model.n_layers", "3", "--checkpoint.fresh_start", "true", "--job.dump_folder", str(trained)]
    assert train_in_process(fresh) == 0
    assert "checkpoint.fresh_start: moved the earlier run's metrics.jsonl, config.toml, checkpoint to" \
        in capsys.readouterr().err
    [aside] = (trained / "set_aside").iterdir()
    assert {name: earlier[name] for name in ("metrics.jsonl", "config.toml", "checkpoint/step-2/.metadata")} == \
        {name: digest for name, digest in folder_hashes(aside).items()
         if name in ("metrics.jsonl", "config.toml", "checkpoint/step-2/.metadata")}
    assert [m["step"] for m in metric_lines(trained)] == [1, 2]
    # The same command again (a requeue), with more steps: it resumes the fresh run's checkpoint.
    assert train_in_process([*fresh, "--training.steps", "4"]) == 0
    assert "resuming it, as a relaunch should" in capsys.readouterr().err
    assert [m["step"] for m in metric_lines(trained)] == [1, 2, 3, 4]
    assert len(list((trained / "set_aside").iterdir())) == 1


def test_a_changed_relaunch_of_a_finished_run_says_it_trains_nothing_and_the_way_on(trained, train_in_process,
                                                                                    capsys):
    before = folder_hashes(trained)
    assert train_in_process([*ARGS, "--optimizer.lr", "0.001", "--job.dump_folder", str(trained)]) == 0
    err = capsys.readouterr().err
    assert (f"{trained} holds a finished run (its checkpoint is at step 2): this launch's changes (optimizer.lr "
            "0.002 → 0.001) apply to no step; for a run of its own, give it its own --job.dump_folder") in err
    assert (f"nothing trained: the checkpoint in {trained} is at step 2 = training.steps; raise --training.steps to "
            "train on, or give a new run its own --job.dump_folder") in err
    assert "resuming" not in err and folder_hashes(trained) == before
    assert train_in_process([*ARGS, "--optimizer.lr", "0.001", "--training.steps", "3", "--job.dump_folder",
                             str(trained)]) == 0
    assert "resuming step 2 with changes since it was saved: optimizer.lr 0.002 → 0.001" in capsys.readouterr().err

"""End-to-end runs of the trainer: exact resume, data parallel parity, checkpoints (the README's quick start runs in
tests/test_docs_run_in_order.py)."""

import gc
import shutil
import subprocess
import sys

import pytest
from conftest import ON_HF, REPO, TINY, losses, torchrun

pytestmark = pytest.mark.slow


def stage_then_close(monkeypatch) -> None:
    """Make DCP's DefaultStager close itself after each staging, as torch 2.11's does (pytorch/pytorch#183413):
    reused for a second save it then fails with `KeyError: <class 'type'>`."""
    from torch.distributed.checkpoint import staging

    stage = staging.DefaultStager._stage

    def closing(self, *args, **kwargs):
        staged = stage(self, *args, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(staging.DefaultStager, "_stage", closing)


@pytest.mark.parametrize("async_mode, cpu_offload, stager_closes", [
    ("disabled", "false", False), ("async", "false", False), ("disabled", "true", False),
    ("async_with_pinned_mem", "false", False), ("async_with_pinned_mem", "false", True)],
    ids=["sync", "async", "cpu_offload", "async_staged", "async_staged_torch_2.11"])
def test_resume_is_bitwise_exact(tmp_path, train_in_process, monkeypatch, async_mode, cpu_offload, stager_closes):
    """20 steps straight == 10 steps, then a resume from the step-10 checkpoint to 20. Staged saves (DCP's stager
    and writing process; on CUDA into pinned memory) save twice a run, also where torch's stager cannot be reused."""
    if stager_closes:
        stage_then_close(monkeypatch)
    args = [*TINY, "--training.steps", "20", "--checkpoint.enable", "true", "--checkpoint.interval", "10",
            "--checkpoint.async_mode", async_mode, "--parallelism.fsdp_cpu_offload", cpu_offload]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_in_process([*args, "--job.dump_folder", str(straight)]) == 0
    assert train_in_process([*args, "--job.dump_folder", str(resumed)]) == 0
    shutil.rmtree(resumed / "checkpoint" / "step-20")
    (resumed / "metrics.jsonl").write_text("")
    assert train_in_process([*args, "--job.dump_folder", str(resumed)]) == 0
    again = losses(resumed)
    assert sorted(again) == list(range(11, 21))
    assert all(again[s] == losses(straight)[s] for s in again), (again, losses(straight))


def test_gradient_accumulation_matches_one_big_batch(tmp_path, train_in_process):
    big, accumulated = tmp_path / "big", tmp_path / "accumulated"
    assert train_in_process([*TINY, "--training.steps", "4", "--training.local_batch_size", "8",
                             "--job.dump_folder", str(big)]) == 0
    assert train_in_process([*TINY, "--training.steps", "4", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "8", "--job.dump_folder", str(accumulated)]) == 0
    for step, loss in losses(big).items():
        assert loss == pytest.approx(losses(accumulated)[step], rel=1e-5)


def test_garbage_is_collected_between_steps_only_and_the_collector_is_restored_after(tmp_path, train_in_process):
    """Automatic collection off during the loop, a full collection after every gc_every_steps-th step; the
    collector on again, nothing frozen, once train.main returns."""
    collections = []  # (generation, whether automatic collection was on)

    def record(phase, info):
        if phase == "start":
            collections.append((info["generation"], gc.isenabled()))

    gc.callbacks.append(record)
    try:
        assert train_in_process([*TINY, "--training.steps", "4", "--training.gc_every_steps", "2",
                                 "--job.dump_folder", str(tmp_path)]) == 0
    finally:
        gc.callbacks.remove(record)
    assert [generation for generation, automatic in collections if not automatic] == [2, 2]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_fsdp_on_two_processes_matches_one_process(tmp_path, train_in_process):
    one, two = tmp_path / "one", tmp_path / "two"
    common = [*TINY, "--training.steps", "8", "--training.global_batch_size", "8"]
    assert train_in_process([*common, "--training.local_batch_size", "8", "--job.dump_folder", str(one)]) == 0
    torchrun(2, [*common, "--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2",
                 "--job.dump_folder", str(two)])
    for step, loss in losses(one).items():
        assert loss == pytest.approx(losses(two)[step], rel=1e-4), step


def test_seed_checkpoint_and_initial_load_path(tmp_path, train_in_process):
    seed = tmp_path / "seed"
    assert train_in_process([*TINY, "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(seed)]) == 0
    assert (seed / "checkpoint" / "step-0" / ".metadata").is_file()
    # Different training seeds, same starting weights: the first losses agree (on the hf loader, whose
    # order does not depend on the seed).
    a, b = tmp_path / "a", tmp_path / "b"
    for dump, training_seed in ((a, "1"), (b, "2")):
        assert train_in_process([*TINY, *ON_HF, "--training.steps", "1", "--training.seed", training_seed,
                                 "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"),
                                 "--job.dump_folder", str(dump)]) == 0
    assert losses(a)[1] == losses(b)[1]


def test_bad_input_fails_with_a_clear_message(tmp_path, train_in_process, capsys):
    assert train_in_process([*TINY, "--model.tokenizer_path", str(tmp_path / "none.model"),
                             "--job.dump_folder", str(tmp_path)]) == 2
    assert "none.model" in capsys.readouterr().err
    assert train_in_process([*TINY, "--training.global_batch_size", "6", "--job.dump_folder", str(tmp_path)]) == 2
    assert "must be a multiple of training.local_batch_size" in capsys.readouterr().err
    assert train_in_process([*TINY, "--parallelism.tensor_parallel_degree", "2",
                             "--job.dump_folder", str(tmp_path)]) == 2
    assert "parallelism" in capsys.readouterr().err
    assert train_in_process([*TINY, "--parallelism.enable_async_tensor_parallel", "true",
                             "--job.dump_folder", str(tmp_path)]) == 2
    expected = "parallelism.enable_async_tensor_parallel needs parallelism.tensor_parallel_degree > 1"
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("data", ["packed", "hf"])
def test_a_run_that_fails_midway_leaves_no_loader_worker_running(tmp_path, train_in_process, monkeypatch, data):
    """The traceback pytest keeps would keep the loader alive; its workers must be stopped anyway, as
    forking again while their queue threads run can crash the next run's workers. (DCP's checkpoint process,
    which async saves of earlier tests may have started, lives as long as the interpreter by design.)"""
    import multiprocessing

    from components.metrics.reporting import MetricsLogger

    def fail(self, step, *args, **kwargs):
        raise RuntimeError(f"failed at step {step}")

    monkeypatch.setattr(MetricsLogger, "log", fail)
    before = set(multiprocessing.active_children())
    source = [] if data == "packed" else ON_HF
    with pytest.raises(RuntimeError, match="failed at step 1") as failure:
        train_in_process([*TINY, *source, "--training.dataloader_workers", "2", "--training.steps", "3",
                          "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)])
    assert failure.traceback  # still held here
    assert set(multiprocessing.active_children()) - before == set()


def test_train_function_stays_within_150_lines_and_no_source_file_over_500():
    """What issue 25 set for a trainer read top to bottom: a new in-loop feature is a module plus one line."""
    import ast

    tree = ast.parse((REPO / "train.py").read_text())
    train = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 150
    sources = [REPO / "train.py", *(p for folder in ("components", "models", "parallelisms", "scripts")
                                     for p in (REPO / folder).rglob("*.py"))]
    long = {str(p.relative_to(REPO)): n for p in sources if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_importing_the_trainer_leaves_torch_s_compiler_unloaded():
    """torch._dynamo loads only in runs that compile or need it (the allgather masks of context parallelism,
    FlexAttention): importing it costs every process start-up time and tens of MB of resident memory, which the
    memory estimator's CPU baseline counts (torch.nn.attention.bias imports it, and once did so from train.py)."""
    code = "import sys, train; print('torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "False"]


def test_a_run_whose_saves_a_background_process_writes_ends_without_a_traceback(tmp_path):
    """checkpoint.async_mode async_with_pinned_mem: DCP's writing process, which torch stops only in a destructor that
    a process ending by os._exit never runs, is stopped as training ends; it died of its closed pipe before, with an
    EOFError traceback in a run that went well (found by the fault soak)."""
    result = subprocess.run(["./run_train.sh", *TINY, "--training.steps", "2", "--checkpoint.enable", "true",
                             "--checkpoint.interval", "2", "--checkpoint.async_mode", "async_with_pinned_mem",
                             "--job.dump_folder", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and (tmp_path / "checkpoint" / "step-2").is_dir(), result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]

"""Loading part of a checkpoint (checkpoint.exclude_from_loading) and ending a run with a Hugging Face
folder (checkpoint.last_save_in_hf)."""

import os

import pytest
import torch
from conftest import TINY, metric_lines

from models.families import load_hf_model
from scripts.checkpoint_model import model_from_checkpoint

ARGS = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--metrics.log_freq", "1"]


def learning_rates(dump) -> dict[int, float]:
    return {m["step"]: m["lr"] for m in metric_lines(dump) if "lr" in m}


def test_a_resume_can_leave_out_the_schedule_and_data_and_keep_the_weights(tmp_path, train_in_process, capsys):
    straight, dump = tmp_path / "straight", tmp_path / "run"
    assert train_in_process([*ARGS, "--training.steps", "4", "--job.dump_folder", str(straight)]) == 0
    assert train_in_process([*ARGS, "--training.steps", "2", "--job.dump_folder", str(dump)]) == 0
    assert train_in_process([*ARGS, "--training.steps", "4", "--job.dump_folder", str(dump),
                             "--checkpoint.exclude_from_loading", "lr_scheduler,dataloader"]) == 0
    assert "resuming without the checkpoint's lr_scheduler, dataloader" in capsys.readouterr().err
    resumed, fresh = learning_rates(dump), learning_rates(straight)
    assert resumed[3] == fresh[1] and resumed[4] == fresh[2]  # the schedule started again
    losses = {m["step"]: m["loss"] for m in metric_lines(dump) if "loss" in m}
    first = {m["step"]: m["loss"] for m in metric_lines(straight) if "loss" in m}
    assert losses[3] < first[1] - 0.1  # the weights were loaded: the first batch again, at a lower loss


def test_leaving_out_an_unknown_part_or_the_step_is_refused(tmp_path, train_in_process, capsys):
    for part in ("dataloaders", "train_state"):
        assert train_in_process([*ARGS, "--checkpoint.exclude_from_loading", part,
                                 "--job.dump_folder", str(tmp_path / part)]) == 2
        err = capsys.readouterr().err
        assert f"checkpoint.exclude_from_loading: '{part}' is not a part a resume can leave out; choose among " \
               "model, optimizer, lr_scheduler, dataloader, step_guard" in err


def test_the_last_checkpoint_is_also_a_folder_transformers_loads(tmp_path, train_in_process):
    assert train_in_process([*ARGS, "--training.steps", "2", "--checkpoint.last_save_in_hf", "true",
                             "--job.dump_folder", str(tmp_path)]) == 0
    folder = tmp_path / "hf" / "step-2"
    assert {"config.json", "model.safetensors", "tokenizer.model"} <= {p.name for p in folder.iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' private 0600
    tokens = torch.randint(0, 4096, (2, 16))
    dcp_model, _, _ = model_from_checkpoint(tmp_path / "checkpoint" / "step-2")
    with torch.no_grad():
        assert torch.equal(load_hf_model(folder)(tokens), dcp_model(tokens))
    transformers = pytest.importorskip("transformers")
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=tokens).logits
    assert torch.allclose(theirs, dcp_model(tokens), atol=1e-4)


def test_exporting_at_the_end_needs_checkpoints(tmp_path, train_in_process, capsys):
    assert train_in_process([*TINY, "--checkpoint.last_save_in_hf", "true", "--job.dump_folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.last_save_in_hf exports the final checkpoint: it needs checkpoint.enable" in err


def test_a_model_without_a_hugging_face_form_is_refused_before_training(tmp_path, train_in_process, capsys):
    assert train_in_process([*ARGS, "--checkpoint.last_save_in_hf", "true", "--model.mup", "true",
                             "--job.dump_folder", str(tmp_path)]) == 2
    assert "model.mup: Hugging Face's LlamaForCausalLM has no output multiplier" in capsys.readouterr().err
    assert not (tmp_path / "checkpoint").exists()

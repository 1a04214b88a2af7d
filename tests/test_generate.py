"""Loading a trained checkpoint into one process (scripts/checkpoint_model.py) and sampling text from it
(scripts/generate.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, torchrun

from components.config import ConfigError
from scripts import generate as cli, hf as converter
from scripts.checkpoint_model import model_from_checkpoint
from scripts.generate import generate, next_token, sampling_probabilities

RUN = [*TINY, "--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "4"]
PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The step-4 checkpoint of a one-process run of the tiny debug model (seq_len 64)."""
    import train

    dump = tmp_path_factory.mktemp("generate") / "run"
    assert train.main([*RUN, "--job.dump_folder", str(dump)]) == 0
    return dump / "checkpoint" / "step-4"


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return model_from_checkpoint(checkpoint)


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT, bos=True)


def token_ids(n: int = 32) -> torch.Tensor:
    return torch.randint(0, 4096, (2, n), generator=torch.Generator().manual_seed(0))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


# --- Sampling on hand-made logits -----------------------------------------------------------------

# Probabilities that are exact in binary, so that every cut falls where the arithmetic says.
PROBS = torch.tensor([0.0625, 0.5, 0.125, 0.25, 0.0625])
LOGITS = PROBS.log()


def kept(probs: torch.Tensor) -> set[int]:
    return set(probs.nonzero().flatten().tolist())


def test_temperature_top_k_and_top_p_keep_exactly_the_expected_tokens():
    torch.testing.assert_close(sampling_probabilities(LOGITS, 1.0), PROBS)
    sharper = PROBS**2 / (PROBS**2).sum()  # temperature 0.5 squares the probabilities
    torch.testing.assert_close(sampling_probabilities(LOGITS, 0.5), sharper)
    top2 = sampling_probabilities(LOGITS, 1.0, top_k=2)
    assert kept(top2) == {1, 3}
    torch.testing.assert_close(top2[[1, 3]], torch.tensor([2 / 3, 1 / 3]))
    # Nucleus: the fewest most likely tokens whose probabilities reach top_p.
    assert kept(sampling_probabilities(LOGITS, 1.0, top_p=0.5)) == {1}
    assert kept(sampling_probabilities(LOGITS, 1.0, top_p=0.75)) == {1, 3}
    assert kept(sampling_probabilities(LOGITS, 1.0, top_p=0.76)) == {1, 3, 2}
    assert kept(sampling_probabilities(LOGITS, 1.0, top_p=1e-9)) == {1}
    # top-p measures the distribution left by top-k: 0.5, 0.25, 0.125 become 4/7, 2/7, 1/7, so 0.8 is
    # reached with two tokens (on the uncut distribution it would take three).
    both = sampling_probabilities(LOGITS, 1.0, top_k=3, top_p=0.8)
    assert kept(both) == {1, 3}
    torch.testing.assert_close(both.sum(), torch.tensor(1.0))


def test_temperature_zero_is_the_argmax_and_bad_settings_are_refused():
    assert next_token(LOGITS, 0.0) == 1
    draws = [next_token(LOGITS, 1.0, top_k=2, generator=torch.Generator().manual_seed(s)) for s in range(50)]
    assert set(draws) == {1, 3}
    for settings in [(-1.0, 0, 1.0), (1.0, -1, 1.0), (1.0, 0, 0.0), (1.0, 0, 1.5)]:
        with pytest.raises(ValueError):
            generate(torch.nn.Linear(1, 1), [0], 1, *settings)


# --- Generation from a trained checkpoint ---------------------------------------------------------


@pytest.mark.slow
def test_greedy_generation_is_deterministic_and_the_argmax_of_the_model_at_each_step(loaded):
    model, config, tokenizer = loaded
    sequence = prompt_ids(tokenizer)
    expected = []
    with torch.no_grad():
        for _ in range(20):
            token = int(model(torch.tensor([sequence]))[0, -1].argmax())
            sequence.append(token)
            expected.append(token)
    greedy = generate(model, prompt_ids(tokenizer), 20, max_seq_len=config.training.seq_len)
    assert greedy == expected
    assert generate(model, prompt_ids(tokenizer), 20, max_seq_len=config.training.seq_len) == greedy
    assert generate(model, prompt_ids(tokenizer), 20, temperature=1.0, top_k=1) == greedy
    assert generate(model, prompt_ids(tokenizer), 20, temperature=1.0, top_p=1e-6) == greedy


@pytest.mark.slow
def test_a_long_sequence_is_cut_to_its_last_seq_len_tokens(loaded):
    """The model's RoPE table covers training.seq_len (64) positions: a longer prompt only fits cut."""
    model, config, tokenizer = loaded
    prompt = tokenizer.encode("Now is the winter of our discontent made glorious summer " * 8, bos=True)
    assert len(prompt) > config.training.seq_len
    new = generate(model, prompt, 3, max_seq_len=config.training.seq_len)
    sequence = list(prompt)
    with torch.no_grad():
        for token in new:
            assert token == int(model(torch.tensor([sequence[-config.training.seq_len:]]))[0, -1].argmax())
            sequence.append(token)


@pytest.mark.slow
def test_sampling_repeats_with_the_same_seed_and_differs_with_another(loaded):
    model, _, tokenizer = loaded

    def sample(seed: int) -> list[int]:
        return generate(model, prompt_ids(tokenizer), 30, temperature=1.0, top_k=100, top_p=0.95,
                        generator=torch.Generator().manual_seed(seed))

    first = sample(0)
    assert len(first) == 30
    assert sample(0) == first
    assert sample(1) != first
    assert first != generate(model, prompt_ids(tokenizer), 30)  # not greedy


@pytest.mark.slow
def test_generation_stops_at_eos(loaded):
    """The greedy continuation's 4th token, taken for EOS, ends generation where it first appears."""
    model, _, tokenizer = loaded
    greedy = generate(model, prompt_ids(tokenizer), 10)
    eos = greedy[3]
    stopped = generate(model, prompt_ids(tokenizer), 10, eos_id=eos)
    assert stopped == greedy[: greedy.index(eos) + 1]


# --- Loading --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_checkpoint_without_its_run_config_asks_for_one(checkpoint, loaded, tmp_path):
    moved = tmp_path / "elsewhere" / "checkpoint" / "step-4"
    shutil.copytree(checkpoint, moved)
    with pytest.raises(ConfigError, match="no config.toml at .* pass the config .* --job.config_file"):
        model_from_checkpoint(moved)
    model, _, _ = model_from_checkpoint(moved, ["--job.config_file", str(checkpoint.parent.parent / "config.toml")])
    with torch.no_grad():
        assert torch.equal(model(token_ids()), loaded[0](token_ids()))


@pytest.mark.slow
def test_a_config_of_another_model_is_refused(checkpoint):
    with pytest.raises(ConfigError, match="model weight layers.2.* is not in the checkpoint"):
        model_from_checkpoint(checkpoint, ["--model.n_layers", "3"])
    with pytest.raises(ConfigError, match="the checkpoint has model weight layers.1"):
        model_from_checkpoint(checkpoint, ["--model.n_layers", "1"])
    with pytest.raises(ConfigError, match="shape"):
        model_from_checkpoint(checkpoint, ["--model.dim", "128"])


@pytest.mark.slow
def test_an_exported_hf_folder_generates_the_same_greedy_text(checkpoint, loaded, tmp_path):
    model, config, tokenizer = loaded
    config_file = checkpoint.parent.parent / "config.toml"
    hf = tmp_path / "hf"
    assert converter.main(["export", "--job.config_file", str(config_file), "--checkpoint", str(checkpoint),
                           "--output", str(hf)]) == 0
    hf_model, hf_config, hf_tokenizer = model_from_checkpoint(hf)  # the folder's own tokenizer.model
    assert hf_config.training.seq_len == config.training.seq_len == 64
    assert hf_tokenizer.encode(PROMPT, bos=True) == prompt_ids(tokenizer)
    ours = generate(model, prompt_ids(tokenizer), 20, max_seq_len=64)
    assert generate(hf_model, prompt_ids(hf_tokenizer), 20, max_seq_len=hf_config.training.seq_len) == ours
    with pytest.raises(ConfigError, match="num_hidden_layers = 2 but the ingot config gives 3"):
        model_from_checkpoint(hf, ["--job.config_file", str(config_file), "--model.n_layers", "3"])


# Each rank of a gloo job loads the whole model and computes the logits of the same tokens; rank 0
# saves every rank's. Arguments: the checkpoint and the output file.
LOAD_ON_EVERY_RANK = """
import sys
import torch
import torch.distributed as dist
from scripts.checkpoint_model import model_from_checkpoint
dist.init_process_group("gloo")
model, _, _ = model_from_checkpoint(sys.argv[1])
with torch.no_grad():
    logits = model(torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0)))
everyone = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, logits)
if dist.get_rank() == 0:
    torch.save(torch.stack(everyone), sys.argv[2])
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_checkpoint_of_two_tensor_parallel_processes_loads_whole_alone_and_on_every_rank(loaded, tmp_path):
    """Trained alike, a TP 2 run's checkpoint gives the one-process run's logits; loaded on both ranks
    of a gloo job (DCP without the process group), it gives each the same whole model."""
    dump = tmp_path / "tp2"
    torchrun(2, [*RUN, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 "--job.dump_folder", str(dump)])
    sharded = dump / "checkpoint" / "step-4"
    model, _, _ = model_from_checkpoint(sharded)
    with torch.no_grad():
        logits = model(token_ids())
        error = relative_error(logits, loaded[0](token_ids()))
    print(f"\nlogits of the TP 2 checkpoint vs the one-process one: relative error {error:.2e}")
    assert error < 1e-4

    saved = tmp_path / "logits.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python",
           sys.executable, "-c", LOAD_ON_EVERY_RANK, str(sharded), str(saved)]
    result = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank_logits in torch.load(saved):
        torch.testing.assert_close(rank_logits, logits)


# --- Command line ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_command_prints_the_prompt_and_its_greedy_continuation(checkpoint, loaded):
    model, _, tokenizer = loaded
    result = subprocess.run(
        [sys.executable, "-m", "scripts.generate", "--checkpoint", str(checkpoint), "--prompt", PROMPT,
         "--max-tokens", "12", "--device", "cpu"],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    continuation = generate(model, prompt_ids(tokenizer), 12)
    assert result.stdout.startswith(PROMPT)
    assert result.stdout == tokenizer.decode(prompt_ids(tokenizer)[1:] + continuation) + "\n"


@pytest.mark.slow
def test_several_samples_are_printed_one_after_the_other(checkpoint, capsys):
    assert cli.main(["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--max-tokens", "5", "--temperature",
                     "0.8", "--num-samples", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if " sample " in line]
    assert [h.strip("- ") for h in headers] == [f"sample {i} of 3" for i in (1, 2, 3)]
    assert out.count(PROMPT) == 3


@pytest.mark.parametrize("problem, args", [
    ("missing checkpoint", ["--checkpoint", "no/such/step-1"]),
    ("bad override", ["--checkpoint", "{checkpoint}", "--training.no_such_key", "1"]),
    ("bad sampling", ["--checkpoint", "{checkpoint}", "--top-p", "0"]),
])
@pytest.mark.slow
def test_bad_input_exits_2_with_one_error_line(checkpoint, capsys, problem, args):
    args = [arg.format(checkpoint=checkpoint) for arg in args]
    assert cli.main([*args, "--prompt", PROMPT]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err

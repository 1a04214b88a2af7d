"""Downstream evaluation in the training loop (components/evaluation/): each request's log-likelihood
equals the model's run on that request alone, the same checkpoint scores the same under every
layout, and evaluating never changes the training trajectory."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, build_model, metric_lines, tiny_model_args, torchrun_runs, train_main

from components.config import load_config
from components.data.tokenizer import build_tokenizer
from components.evaluation.scoring import (
    IGNORE,
    Request,
    accuracies,
    plan_batches,
    prepare_task,
    request_loglikelihoods,
    rows,
    split_like_lm_eval,
)
from components.evaluation.tasks import Example, Task, read_task
from components.training.loss import sequence_loglikelihoods
from models.families import model_config_class

TASK = REPO / "tests/assets/tasks/shakespeare_next_line.jsonl"
TOKENIZER = REPO / "tests/assets/tokenizers/shakespeare_bpe_4k.model"
EVAL = ["--evaluation.enable", "true", "--evaluation.tasks", str(TASK), "--evaluation.limit", "24"]


def eval_records(dump) -> dict[int, dict]:
    return {m["step"]: m for m in metric_lines(dump) if "eval_seconds" in m}


def test_a_row_scores_only_the_continuation():
    requests = [Request(0, 0, [1, 10, 11, 12, 13], continuation=2), Request(0, 1, [1, 20, 21], continuation=1)]
    windows, labels = rows(requests, [1, 0], batch_size=3, length=6)
    assert windows.tolist() == [[1, 20, 21, 0, 0, 0, 0], [1, 10, 11, 12, 13, 0, 0], [0] * 7]
    assert labels.tolist() == [[IGNORE, 21, IGNORE, IGNORE, IGNORE, IGNORE],
                               [IGNORE, IGNORE, 12, 13, IGNORE, IGNORE], [IGNORE] * 6]


def test_every_rank_runs_the_same_forwards_and_each_request_is_scored_once():
    requests = [Request(i, 0, [1] * n, 1) for i, n in enumerate([5, 70, 9, 33, 130, 12, 64, 65, 3, 200, 17])]
    plans = [list(plan_batches(requests, rank, 3, batch_size=2, seq_len=256, multiple=64, fixed_length=False))
             for rank in range(3)]
    assert [[(length, count) for length, count, _ in plan] for plan in plans] == [[(256, 2), (64, 8)]] * 3
    dealt = [r for plan in plans for _, count, batch in plan for r in batch]
    assert sorted(dealt) == list(range(len(requests)))
    assert all(len(batch) <= count for plan in plans for _, count, batch in plan)
    fixed = list(plan_batches(requests, 0, 3, batch_size=2, seq_len=256, multiple=64, fixed_length=True))
    assert [(length, count) for length, count, _ in fixed] == [(256, 2), (256, 2)]


def test_trailing_space_moves_to_the_continuation_as_in_lm_eval():
    assert split_like_lm_eval("Question: why?\nAnswer: ", " yes") == ("Question: why?\nAnswer:", "  yes")
    assert split_like_lm_eval("ROMEO.\n", "") == ("ROMEO.", "\n")


def test_acc_norm_divides_by_the_choice_length_and_ties_go_to_the_first():
    task = Task("t", "generic", TASK, [Example("c", ["a", "bbbb"], 1), Example("c", ["x", "y"], 0)])
    requests = [Request(e, c, [1, 2], 1) for e in range(2) for c in range(2)]
    figures = accuracies(task, requests, torch.tensor([-2.0, -4.0, -1.0, -1.0]))
    assert figures == {"acc": 0.5, "acc_norm": 1.0, "examples": 2}


def test_each_loglikelihood_equals_the_model_on_that_request_alone():
    """Batched, padded, sorted and dealt out to 2 'ranks': the same log-likelihoods as running each
    request unpadded through the model and summing log_softmax at its continuation tokens."""
    tokenizer = build_tokenizer(TOKENIZER)
    model = build_model(tiny_model_args(vocab_size=tokenizer.vocab_size, max_seq_len=64)).eval()
    examples = [Example("ROMEO.\nBut soft, what light through yonder window", [" breaks?", " sings", " is it"], 0),
                Example("Question: Who wrote Hamlet?\nAnswer:", ["Shakespeare", "Marlowe"], 0, " "),
                Example("JULIET.\n", ["O Romeo, Romeo!", "Good night."], 1, "")]
    prepared = prepare_task(Task("t", "generic", TASK, examples), tokenizer, seq_len=64)

    def score(windows, labels):
        with torch.no_grad():
            return sequence_loglikelihoods(model(windows[:, :-1]), labels)

    shares = [request_loglikelihoods(prepared, score, lambda t: t, rank, 2, batch_size=2, seq_len=64, multiple=8,
                                     fixed_length=False, device=torch.device("cpu")) for rank in range(2)]
    batched = shares[0] + shares[1]
    for request, value in zip(prepared.requests, batched.tolist()):
        tokens = torch.tensor(request.tokens)
        context, continuation = split_like_lm_eval(examples[request.example].context,
                                                   examples[request.example].delimiter
                                                   + examples[request.example].choices[request.choice])
        assert tokenizer.decode(request.tokens[1:]) == context + continuation
        with torch.no_grad():
            logprobs = model(tokens[None, :-1])[0].log_softmax(-1)
        n = request.continuation
        expected = logprobs[-n:].gather(1, tokens[-n:, None]).sum().item()
        assert value == pytest.approx(expected, abs=1e-4)


def test_the_debug_config_lists_the_shipped_task():
    config = load_config(["--job.config_file", "debug_model.toml"], model_config_class)
    assert config.evaluation.tasks == ["tests/assets/tasks/shakespeare_word_order.jsonl",
                                       "tests/assets/tasks/shakespeare_next_line.jsonl"]
    assert not config.evaluation.enable


def test_evaluation_never_changes_the_training_trajectory(tmp_path, train_in_process):
    runs = {}
    for name, extra in {"off": [], "on": [*EVAL, "--evaluation.freq", "2"]}.items():
        dump = tmp_path / name
        assert train_in_process([*TINY, "--training.steps", "5", "--metrics.log_freq", "1",
                                 "--job.dump_folder", str(dump), *extra]) == 0
        runs[name] = [m["loss"] for m in metric_lines(dump) if "loss" in m]
    assert runs["on"] == runs["off"]
    records = eval_records(tmp_path / "on")
    assert sorted(records) == [2, 4, 5]
    assert {"eval/shakespeare_next_line/acc", "eval/shakespeare_next_line/acc_norm"} <= set(records[5])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model trained 6 steps on one process."""
    dump = tmp_path_factory.mktemp("trained")
    assert train_main([*TINY, "--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "6",
                "--job.dump_folder", str(dump)]) == 0
    return dump / "checkpoint" / "step-6"


def evaluation_of(checkpoint) -> list[str]:
    """A run that evaluates the checkpoint's weights once: one step at lr 0 (the weights stay as loaded), then the
    evaluation."""
    return [*TINY, *EVAL, "--checkpoint.initial_load_path", str(checkpoint), "--optimizer.lr", "0",
            "--training.steps", "1", "--evaluation.freq", "1"]


def scores(dump) -> dict:
    return {key: value for key, value in eval_records(dump)[1].items() if key.startswith("eval/")}


@pytest.fixture(scope="module")
def one_process_scores(checkpoint, tmp_path_factory) -> dict:
    """The checkpoint evaluated on one process: what every layout and scripts.eval must score."""
    dump = tmp_path_factory.mktemp("one_process")
    assert train_main([*evaluation_of(checkpoint), "--job.dump_folder", str(dump)]) == 0
    assert scores(dump)["eval/shakespeare_next_line/acc"] > 0
    return scores(dump)


LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]),
    "document_masking": (1, ["--training.document_masking", "true"]),
}


MOE = ["--job.config_file", "debug_moe.toml", "--model.n_layers", "2", "--training.seq_len", "64",
       "--training.local_batch_size", "4", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
       "--training.steps", "2", "--evaluation.freq", "2", "--optimizer.lr", "0", *EVAL]


@pytest.fixture(scope="module")
def layout_runs(checkpoint, tmp_path_factory):
    """The checkpoint evaluated under every layout, and the MoE model under expert parallelism 2."""
    runs = {name: (nproc, [*evaluation_of(checkpoint), *flags]) for name, (nproc, flags) in LAYOUTS.items()}
    runs["moe_ep2"] = (2, [*MOE, "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"])
    return torchrun_runs(runs, tmp_path_factory.mktemp("layouts"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_checkpoint_scores_the_same_under_every_layout(layout_runs, one_process_scores, layout):
    dump, problem = layout_runs[layout]
    assert not problem, problem
    assert scores(dump) == one_process_scores


@pytest.mark.slow
def test_a_mixture_of_experts_model_scores_the_same_with_expert_parallelism(tmp_path, layout_runs):
    assert train_main([*MOE, "--job.dump_folder", str(tmp_path / "one")]) == 0
    dump, problem = layout_runs["moe_ep2"]
    assert not problem, problem
    one, ep2 = eval_records(tmp_path / "one")[2], eval_records(dump)[2]
    assert {k: v for k, v in one.items() if k.startswith("eval/")} == {
        k: v for k, v in ep2.items() if k.startswith("eval/")}


def run_eval(nproc: int, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    command = [sys.executable, *launcher, "-m", "scripts.eval", *map(str, args)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_scripts_eval_on_two_processes_equals_the_in_loop_evaluation(checkpoint, one_process_scores, tmp_path):
    result = run_eval(2, "--checkpoint", checkpoint, "--tasks", TASK, "--limit", "24", "--json", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr[-3000:]
    offline = json.loads((tmp_path / "r.json").read_text())["shakespeare_next_line"]
    assert offline["examples"] == 24
    assert {f"eval/shakespeare_next_line/{m}": offline[m] for m in ("acc", "acc_norm")} == one_process_scores
    assert result.stdout.splitlines()[0] == "| task | examples | acc | acc_norm |"
    assert result.stdout.count("| shakespeare_next_line | 24 |") == 1  # rank 0 prints, once


@pytest.mark.slow
def test_scripts_eval_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    result = run_eval(1, "--checkpoint", tmp_path / "nothing", "--tasks", TASK)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: ")


def lm_eval_scores(hf_folder, examples, max_length: int) -> tuple[list[list[float]], dict[str, float]]:
    """lm-evaluation-harness's multiple-choice scoring with its Hugging Face backend (add_bos_token=True),
    written out with transformers: per-choice log-likelihoods, acc and acc_norm."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_folder)

    def encode(text: str) -> list[int]:
        return [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]

    all_scores, correct, correct_norm = [], 0, 0
    for example in examples:
        scores = []
        for choice in example.choices:
            context, continuation = example.context, example.delimiter + choice
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole, context_ids = encode(context + continuation), encode(context)
            scored = whole[len(context_ids):]
            inputs = torch.tensor(whole[-(max_length + 1):][:-1])[None]
            with torch.no_grad():
                logprobs = model(input_ids=inputs).logits[0, -len(scored):].float().log_softmax(-1)
            scores.append(logprobs.gather(1, torch.tensor(scored)[:, None]).sum().item())
        all_scores.append(scores)
        lengths = [float(len(choice)) for choice in example.choices]
        correct += int(np.argmax(scores)) == example.gold
        correct_norm += int(np.argmax(np.array(scores) / lengths)) == example.gold
    return all_scores, {"acc": correct / len(examples), "acc_norm": correct_norm / len(examples)}


@pytest.mark.slow
def test_scores_equal_lm_eval_style_scoring_of_the_exported_model(checkpoint, tmp_path):
    """The checkpoint exported to Hugging Face and scored as lm-eval's HF backend scores: the same
    acc and acc_norm as scripts.eval (and so as the training loop), each log-likelihood within 1e-4."""
    from scripts.checkpoint_model import model_from_checkpoint

    export = subprocess.run([sys.executable, "-m", "scripts.hf", "export", *TINY, "--checkpoint", str(checkpoint),
                             "--output", str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True)
    assert export.returncode == 0, export.stderr[-2000:]
    task = read_task(str(TASK), limit=24)
    reference, figures = lm_eval_scores(tmp_path / "hf", task.examples, max_length=64)

    model, config, tokenizer = model_from_checkpoint(checkpoint)
    prepared = prepare_task(task, tokenizer, config.training.seq_len)

    def score(windows, labels):
        with torch.no_grad():
            return sequence_loglikelihoods(model(windows[:, :-1]), labels)

    ours = request_loglikelihoods(prepared, score, lambda t: t, 0, 1, 8, 64, 64, False, torch.device("cpu"))
    for request, value in zip(prepared.requests, ours.tolist()):
        assert value == pytest.approx(reference[request.example][request.choice], abs=1e-4)
    assert accuracies(task, prepared.requests, ours) == {**figures, "examples": 24}
    result = run_eval(1, "--checkpoint", checkpoint, "--tasks", TASK, "--limit", "24", "--json", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "r.json").read_text())["shakespeare_next_line"] == {**figures, "examples": 24}

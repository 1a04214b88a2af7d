"""Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores them.

Each (example, choice) pair is one request: the context, then delimiter + choice. Its score is the
summed log-probability of the choice's tokens given everything before them. acc: the choice with
the highest score is the gold one; acc_norm: the same after dividing each score by the choice's
length in characters. Tokens follow lm-eval: a trailing space of the context moves to the front of
the continuation, context + continuation is encoded as a whole and the continuation's tokens are
what it adds to the context's encoding; a BOS goes in front, as training documents start with one
(lm-eval's Hugging Face backend with add_bos_token=True). A request longer than seq_len + 1 tokens
loses its first ones.

The requests are sorted by length and dealt out to the data-parallel ranks in forwards of about the
training batch's tokens: rows just long enough for the longest request of the forward, more rows
when they are short (under pipeline parallelism: the training shapes, which its stages expect).
Every rank runs the same forwards, padded with empty rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from components.data.tokenizer import Tokenizer
from components.evaluation.tasks import Task

IGNORE = -100
"""Label of a position whose token is not scored (cross_entropy's ignore_index)."""


@dataclass(frozen=True)
class Request:
    example: int
    choice: int
    tokens: list[int]
    """BOS, context, continuation; at most seq_len + 1 tokens."""
    continuation: int
    """How many of the last tokens are scored."""


@dataclass(frozen=True)
class PreparedTask:
    task: Task
    requests: list[Request]


def split_like_lm_eval(context: str, continuation: str) -> tuple[str, str]:
    """Move the context's trailing whitespace to the front of the continuation."""
    stripped = context.rstrip()
    return stripped, context[len(stripped):] + continuation


def prepare_task(task: Task, tokenizer: Tokenizer, seq_len: int) -> PreparedTask:
    """Every request of a task, tokenized once."""
    requests = []
    for i, example in enumerate(task.examples):
        context_tokens = None  # the same for every choice: the split depends on the context alone
        for j, choice in enumerate(example.choices):
            context, continuation = split_like_lm_eval(example.context, example.delimiter + choice)
            context_tokens = context_tokens or len(tokenizer.encode(context, bos=True))
            whole = tokenizer.encode(context + continuation, bos=True)
            scored = len(whole) - context_tokens
            if not 0 < scored <= seq_len:
                raise ValueError(f"{task.path}: example {i + 1}, choice {j + 1} is {max(scored, 0)} tokens after its "
                                 f"context; it must be 1 to training.seq_len ({seq_len})")
            requests.append(Request(i, j, whole[-(seq_len + 1):], scored))
    return PreparedTask(task, requests)


def row_length(longest: int, seq_len: int, multiple: int) -> int:
    """Rows just long enough for `longest` input tokens: `multiple` times a power of two, at most
    seq_len (few distinct lengths, so compiled blocks see few shapes)."""
    length = multiple
    while length < longest:
        length *= 2
    return min(length, seq_len)


def plan_batches(requests: list[Request], dp_rank: int, dp: int, batch_size: int, seq_len: int, multiple: int,
                 fixed_length: bool) -> Iterator[tuple[int, int, list[int]]]:
    """(row length, rows, this rank's request indices) of each forward, longest requests first. Every
    rank runs the same forwards with the same shapes: each takes the next rows x dp requests, dealt
    out round-robin. Rows of the training length come batch_size at a time; shorter rows come in
    larger batches of the same number of tokens."""
    order = sorted(range(len(requests)), key=lambda r: -len(requests[r].tokens))
    start = 0
    while start < len(order):
        length = seq_len if fixed_length else row_length(len(requests[order[start]].tokens) - 1, seq_len, multiple)
        count = batch_size * seq_len // length
        yield length, count, order[start:start + count * dp][dp_rank::dp]
        start += count * dp


def rows(requests: list[Request], batch: list[int], batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch_size, length + 1) token windows and (batch_size, length) labels of a batch: each
    request's inputs from the left, IGNORE except on its continuation; empty rows fill the rest."""
    windows = torch.zeros(batch_size, length + 1, dtype=torch.long)
    labels = torch.full((batch_size, length), IGNORE, dtype=torch.long)
    for row, index in enumerate(batch):
        request = requests[index]
        tokens = torch.tensor(request.tokens)
        n = len(tokens)
        windows[row, :n] = tokens
        labels[row, n - 1 - request.continuation:n - 1] = tokens[n - request.continuation:]
    return windows, labels


def accuracies(task: Task, requests: list[Request], loglikelihoods: torch.Tensor) -> dict[str, float]:
    """acc and acc_norm of a task from the log-likelihood of each of its requests."""
    by_example: list[list[float]] = [[] for _ in task.examples]
    for request, value in zip(requests, loglikelihoods.tolist()):
        by_example[request.example].append(value)
    correct = correct_norm = 0
    for example, scores in zip(task.examples, by_example):
        lengths = [len(choice) for choice in example.choices]
        correct += argmax(scores) == example.gold
        correct_norm += argmax([s / n for s, n in zip(scores, lengths)]) == example.gold
    n = len(task.examples)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "examples": n}


def argmax(values: list[float]) -> int:
    """The first index of the largest value, as numpy's argmax (lm-eval's) breaks ties."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def request_loglikelihoods(
    prepared: PreparedTask,
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    dp_rank: int,
    dp: int,
    batch_size: int,
    seq_len: int,
    multiple: int,
    fixed_length: bool,
    device: torch.device,
) -> torch.Tensor:
    """The log-likelihood of each request of a task (in its order), the same on every rank.

    `score(windows, labels)`: each row's summed log-probability of its labelled tokens, as far as
    this rank computes it (a context-parallel share of the sequence, zeros off the last pipeline
    stage); `reduce_sum` adds a tensor up over the ranks whose shares make the whole. `multiple`
    divides every row length (what context and tensor parallelism need); `fixed_length`: batches of
    batch_size rows of seq_len tokens always."""
    requests = prepared.requests
    totals = torch.zeros(len(requests), device=device)
    for length, count, batch in plan_batches(requests, dp_rank, dp, batch_size, seq_len, multiple, fixed_length):
        windows, labels = rows(requests, batch, count, length)
        scores = score(windows, labels)
        if batch:
            totals[torch.tensor(batch, device=device)] += scores[:len(batch)].float()
    return reduce_sum(totals).cpu()


def evaluate_task(prepared: PreparedTask, *args, **kwargs) -> dict[str, float]:
    """acc, acc_norm and the number of examples of one task; arguments as request_loglikelihoods."""
    return accuracies(prepared.task, prepared.requests, request_loglikelihoods(prepared, *args, **kwargs))

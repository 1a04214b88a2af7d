"""Tokenizing in worker processes: a task's parts become BOS + tokens + EOS per kept document, in order.

Results come back in the order the tasks were submitted, whichever worker finishes first, so the
output is the corpus in input order and the same for any number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from components.data.packed_format import token_dtype
from components.data.tokenizer import build_tokenizer

REASONS = {  # why a line was skipped: key in the manifest -> words in messages
    "empty_line": "empty line",
    "invalid_json": "not valid JSON",
    "invalid_utf8": "not valid UTF-8",
    "not_an_object": "JSON value is not an object",
    "missing_field": "no text field",
    "null_text": "text is null",
    "not_a_string": "text is not a string",
    "empty_text": "text is empty",
    "encode_error": "the tokenizer failed on the text",
}


class Encoder:
    """What a worker does with a task: texts out of its parts (see inputs.py), checked, tokenized as BOS + ids + EOS."""

    def __init__(self, tokenizer_path: str, text_field: str):
        self.tokenizer = build_tokenizer(tokenizer_path)
        self.text_field = text_field
        self.dtype = token_dtype(self.tokenizer.vocab_size)

    def _json_text(self, line: bytes):
        if not line.strip():
            return None, "empty_line"
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            return None, "invalid_utf8"
        except ValueError:
            return None, "invalid_json"
        if not isinstance(record, dict):
            return None, "not_an_object"
        if self.text_field not in record:
            return None, "missing_field"
        return record[self.text_field], None

    def __call__(self, parts: list) -> tuple[np.ndarray, np.ndarray, list, list, int, float]:
        """-> (tokens of the kept documents back to back, their lengths, [(source index, documents kept)]
        per part, [(source index, line, reason)] of the skipped ones, lines read, CPU seconds spent)."""
        cpu = time.process_time()
        encode, bos, eos = self.tokenizer.encode, self.tokenizer.bos_id, self.tokenizer.eos_id
        flat: list[int] = []
        lengths: list[int] = []
        kept: list[tuple[int, int]] = []
        bad: list[tuple[int, int, str]] = []
        lines = 0
        for kind, source, first, count, payload, _ in parts:
            lines += count
            documents = len(lengths)
            if kind == "lines":
                items = payload.split(b"\n")
                if len(items) > count:  # the block ends with a newline: no line after it
                    items.pop()
            elif kind == "file":
                items = [payload]
            else:
                items = payload
            for offset, item in enumerate(items):
                reason = None
                if kind == "lines":
                    text, reason = self._json_text(item)
                elif kind == "file":
                    try:
                        text = item.decode("utf-8-sig")
                    except UnicodeDecodeError:
                        text, reason = None, "invalid_utf8"
                else:
                    text = item
                if reason is None:
                    if text is None:
                        reason = "null_text"
                    elif not isinstance(text, str):
                        reason = "not_a_string"
                    elif not text.strip():
                        reason = "empty_text"
                if reason is None:
                    try:
                        ids = encode(text)  # no BOS/EOS: added here, the same as encode(bos=True, eos=True)
                    except Exception:  # noqa: BLE001 - a text the tokenizer cannot take is one bad line
                        reason = "encode_error"
                if reason is not None:
                    bad.append((source, first + offset, reason))
                    continue
                flat.append(bos)
                flat.extend(ids)
                flat.append(eos)
                lengths.append(len(ids) + 2)
            kept.append((source, len(lengths) - documents))
        tokens = np.array(flat, dtype=self.dtype)
        return tokens, np.array(lengths, dtype=np.int64), kept, bad, lines, time.process_time() - cpu


_ENCODER: Encoder | None = None


def _init_worker(tokenizer_path: str, text_field: str) -> None:
    global _ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the main process alone
    _ENCODER = Encoder(tokenizer_path, text_field)


def _encode_task(parts: list):
    return _ENCODER(parts)


def ordered_results(tasks, workers: int, tokenizer_path: str, text_field: str):
    """The results of the tasks in task order, tokenized by `workers` processes (0: in this
    process), with at most 2 * workers + 1 tasks in flight."""
    if workers == 0:
        encoder = Encoder(tokenizer_path, text_field)
        for task in tasks:
            yield encoder(task)
        return
    # fork starts workers fastest and needs no re-import; elsewhere spawn is the safe choice.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                   initargs=(tokenizer_path, text_field))
    pending: deque = deque()
    try:
        for task in tasks:
            pending.append(executor.submit(_encode_task, task))
            if len(pending) > 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)

"""What preprocessing tells the user on stderr: a progress line while it runs, and one-line messages."""

from __future__ import annotations

import sys
import time


def si(x: float) -> str:
    """`x` with a K, M or G suffix and two decimals, for rates and counts in messages."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= limit:
            return f"{x / limit:.2f}{suffix}"
    return f"{x:.0f}"


def log(message: str) -> None:
    print(f"preprocess: {message}", file=sys.stderr, flush=True)


class Progress:
    """A line on stderr: rewritten in place every second on a terminal, printed every 10 s otherwise;
    `label` goes before the figures (whose they are)."""

    def __init__(self, stream=None, enabled: bool = True, label: str = ""):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if hasattr(self.stream, "isatty") else False
        self.enabled, self.label = enabled, label
        self.start = self.last = time.monotonic()
        self.interval = 1.0 if self.tty else 10.0
        self.shown = False

    def update(self, documents: int, tokens: int, skipped: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.interval and not force):
            return
        self.last = now
        seconds = max(now - self.start, 1e-9)
        line = (f"preprocess: {self.label}{documents:,} documents  {si(documents / seconds)} docs/s  "
                f"{si(tokens)} tokens  {si(tokens / seconds)} tokens/s  {skipped:,} skipped  {seconds:.0f} s")
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False

"""The values a numeric config key allows (schema.RANGES, and each model family's `Model.ranges`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """The values a numeric key allows: from `low` up to `high` (either end left open by `open_low` or
    `open_high`; None: no bound), plus the sentinels in `also` (e.g. -1: derived). Floats must be finite."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    also: tuple[int, ...] = ()
    note: str = ""
    """What a special value means, e.g. "0: off"."""

    def allows(self, value: float) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.open_low else value >= self.low)
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return above and below

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.open_low else '['}{self.low}, {self.high}{')' if self.open_high else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.open_low else '>='} {self.low}"
        else:
            text = f"{'<' if self.open_high else '<='} {self.high}"
        text += "".join(f" or {value}" for value in self.also)
        return text + (f" ({self.note})" if self.note else "")


COUNT, OFF_AT_0, POSITIVE = Range(1), Range(0, note="0: off"), Range(0, open_low=True)
NON_NEGATIVE, FRACTION, DECAY = Range(0), Range(0, 1), Range(0, 1, open_high=True)

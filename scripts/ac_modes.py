"""Activation checkpointing as the layout tools name it (autotune's candidates, preflight's layouts): none, full, op
(selective by op) or N (selective, every N-th block), and the config arguments that set it."""

from __future__ import annotations


def ac_flags(ac: str) -> list[str]:
    """The config arguments of an activation checkpointing mode: none, full, op or N (selective)."""
    if ac in ("none", "full"):
        return ["--activation_checkpoint.mode", ac]
    return ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", ac]

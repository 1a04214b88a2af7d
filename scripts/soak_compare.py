"""Two runs compared bit for bit, for the fault soak (scripts/soak.py): the steps each logged, every step's loss and
gradient norm, every entry of the final checkpoint (weights, optimizer state, data loader position, RNG states)."""

from __future__ import annotations

import json
from pathlib import Path


def final_state(run: Path, steps: int, scratch: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{run.name}.pt"
    dcp_to_torch_save(str(run / "checkpoint" / f"step-{steps}"), str(out))
    return torch.load(out, weights_only=False)


def differences(reference: Path, faulty: Path, steps: int, scratch: Path) -> list[str]:
    """Where the faulty run differs from the reference: the steps logged, each step's loss and gradient norm, every
    entry of the final checkpoint, bit for bit."""
    import torch

    found = []

    def records(run: Path) -> list[dict]:
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    ours, theirs = records(faulty), records(reference)
    if [r["step"] for r in ours] != list(range(1, steps + 1)):
        found.append(f"steps logged: {[r['step'] for r in ours]}")
    for a, b in zip(ours, theirs):
        if (a["loss"], a["grad_norm"]) != (b["loss"], b["grad_norm"]):
            found.append(f"step {a['step']}: loss {a['loss']!r} vs {b['loss']!r}, grad_norm {a['grad_norm']!r} vs "
                         f"{b['grad_norm']!r}")
    flat_a, flat_b = flatten(final_state(faulty, steps, scratch)), flatten(final_state(reference, steps, scratch))
    for key in sorted(set(flat_a) | set(flat_b)):
        a, b = flat_a.get(key), flat_b.get(key)
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
        if not same:
            found.append(f"final checkpoint entry {key} differs")
    return found


def flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)) and not all(isinstance(v, (int, float, str)) for v in value):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}

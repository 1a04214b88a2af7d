"""Estimate the peak memory of one training rank before running it. How it works, and how close it
comes to measured runs: docs/memory_estimate.md."""

from scripts.memory_estimate.breakdown import CPU_TRAINER_STATE, LABELS, PARTS, MemoryEstimate
from scripts.memory_estimate.estimator import cpu_baseline_bytes, default_target, estimate
from scripts.memory_estimate.simulation import blocks_to_simulate, simulate_micro_batch

__all__ = [
    "CPU_TRAINER_STATE", "LABELS", "PARTS", "MemoryEstimate", "blocks_to_simulate", "cpu_baseline_bytes",
    "default_target", "estimate", "simulate_micro_batch",
]

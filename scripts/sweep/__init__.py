"""Hyperparameter sweeps and run comparisons: `python -m scripts.sweep --help`; docs/ablations.md describes them."""

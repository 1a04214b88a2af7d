"""The benchmark matrix, `python -m scripts.benchmark --preset {tiny,cpu,h100}` (docs/benchmarks.md)."""

"""Benchmarks: scripts that print figures (tokens/s, samples/s, seconds).

Each runs as `python -m scripts.benchmarks.<name>`."""

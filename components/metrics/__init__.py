"""What a run reports: the log line, metrics.jsonl and TensorBoard (reporting.py), Weights & Biases, per-block
statistics, the weights' norm, per-rank step times and profiler traces, one file each."""

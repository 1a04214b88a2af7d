"""Offline tools that a training run never imports: preprocessing, tokenizer training, Hugging Face
conversion, sweeps, memory estimates, autotune and benchmarks. Each is `python -m scripts.<name>`."""

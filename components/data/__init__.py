"""Training and validation data: batches of token windows of shape (local_batch_size, seq_len + 1),
built by loaders.py.

Two sources (`training.dataset`):
- hf: local JSONL/text/Parquet files or a `save_to_disk` folder, tokenized and packed on the fly
  (local_files.py): no preparation, for small data;
- packed: folders written once by `python -m scripts.preprocess` (in the format of packed_format.py),
  memory-mapped with a global shuffle (packed.py): for real runs.

Both keep their position in the global stream of samples, so checkpoints resume exactly, also under
another data-parallel degree.
"""

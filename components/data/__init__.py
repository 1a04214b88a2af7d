"""Training and validation data: batches of token windows of shape (local_batch_size, seq_len + 1),
built by loaders.py.

Two sources (`training.dataset`):
- hf: files, local dataset repositories or hub datasets streamed with `datasets`, each data-parallel
  rank reading its own share, tokenized and packed in loader workers (streaming.py): no preparation,
  any size; resumes exactly under the same layout;
- packed: folders written once by `python -m scripts.preprocess` (in the format of packed_format.py),
  memory-mapped with a global shuffle (packed.py): resumes exactly under any layout.
"""

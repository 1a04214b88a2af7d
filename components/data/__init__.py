"""Training and validation data: batches of token windows of shape (local_batch_size, seq_len + 1),
built by loaders.py. Every step's global batch is the same under every layout of the same global batch size.

Two sources (`training.dataset`):
- hf: files, local dataset repositories or hub datasets read as they are (sources.py), in one stream per
  sequence of the global batch, each data-parallel rank reading its streams, tokenized and packed in loader
  workers (streaming.py): no preparation, any size; resumes exactly on any number of processes;
- packed: folders written once by `python -m scripts.preprocess` (in the format of packed_format.py),
  memory-mapped with a global shuffle (packed.py): resumes exactly under any layout.
"""

"""The packed-data training loader (components/data/packed.py) on small packed folders built here."""

import gc
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from components.data.packed import FeistelPermutation, build_packed_dataloader, parse_path
from components.data.packed_format import ShardWriter, tokenizer_fingerprint, write_manifest

ASSETS = Path(__file__).parent / "assets" / "tokenizers"
TOKENIZER = str(ASSETS / "shakespeare_bpe_4k.model")
SEQ = 8


def make_folder(path: Path, first_token: int = 0, train_tokens: int = 201, validation_tokens: int = 81) -> dict:
    """A packed folder whose token stream of each split is first_token, first_token + 1, ... (so a
    token names its position), cut into documents of 1 to 12 tokens and shards of ~50 tokens.
    Returns the flat streams."""
    path.mkdir()
    rng, splits, streams = np.random.default_rng(len(str(path))), {}, {}
    for split, count in (("train", train_tokens), ("validation", validation_tokens)):
        stream = np.arange(first_token, first_token + count, dtype=np.uint16)
        cuts = np.cumsum(rng.integers(1, 13, size=count))
        writer = ShardWriter(path, split, np.uint16, shard_tokens=50)
        for document in np.split(stream, cuts[cuts < count]):
            writer.write(document)
        shards = writer.close()
        splits[split] = {"documents": sum(s["documents"] for s in shards), "tokens": count, "shards": shards}
        streams[split] = torch.from_numpy(stream.astype(np.int64))
    tokenizer = {"path": TOKENIZER, "fingerprint": tokenizer_fingerprint(TOKENIZER), "vocab_size": 4096,
                 "bos_id": 1, "eos_id": 2}
    write_manifest(path, {"dtype": "uint16", "tokenizer": tokenizer, "splits": splits})
    return streams


@pytest.fixture
def folder(tmp_path):
    """One folder: 201 train tokens = 25 windows of SEQ + 1."""
    make_folder(tmp_path / "a")
    return str(tmp_path / "a")


def loader(paths, local_batch_size=3, dp_rank=0, dp_size=1, seed=0, num_workers=0, split="train", shuffle=True):
    paths = paths if isinstance(paths, list) else [paths]
    return build_packed_dataloader(paths, split, TOKENIZER, SEQ, local_batch_size, dp_rank, dp_size, seed, num_workers,
                                   shuffle)


def take(data, batches: int) -> list[torch.Tensor]:
    return list(islice(iter(data), batches))


def windows(batches) -> list[int]:
    """The window index of every sample (its first token / SEQ, the folder's tokens being 0, 1, ...)."""
    return [int(sample[0]) // SEQ for batch in batches for sample in batch]


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4097])
def test_feistel_is_a_deterministic_permutation(n):
    order = [FeistelPermutation(n, 5, 0)(i) for i in range(n)]
    assert sorted(order) == list(range(n))
    assert order == [FeistelPermutation(n, 5, 0)(i) for i in range(n)]


def test_feistel_differs_across_epochs_and_seeds():
    keys = [(0, 0), (0, 1), (1, 0), (1, 1)]
    orders = {tuple(FeistelPermutation(1000, seed, epoch)(i) for i in range(1000)) for seed, epoch in keys}
    assert len(orders) == 4 and tuple(range(1000)) not in orders
    assert len({tuple(FeistelPermutation(2, 0, epoch)(i) for i in range(2)) for epoch in range(20)}) == 2


def test_windows_are_the_right_tokens(tmp_path):
    stream = make_folder(tmp_path / "a")["train"]
    batches = take(loader(str(tmp_path / "a"), shuffle=False), 100)
    assert all(b.shape == (3, SEQ + 1) and b.dtype == torch.int64 for b in batches)
    samples = [sample for batch in batches for sample in batch]
    assert len(samples) == 24  # 25 windows, the whole batches of 3
    for i, sample in enumerate(samples):  # windows cross document and shard boundaries and share one token
        assert torch.equal(sample, stream[i * SEQ : i * SEQ + SEQ + 1])


def test_shuffle_reads_every_window_once_per_epoch(folder):
    epochs = np.array(windows(take(loader(folder, local_batch_size=5), 15))).reshape(3, 25)  # 3 epochs of 25 windows
    assert all(sorted(epoch) == list(range(25)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3 and tuple(range(25)) not in {tuple(e) for e in epochs}
    assert windows(take(loader(folder, local_batch_size=5), 5)) == list(epochs[0])  # deterministic
    assert windows(take(loader(folder, local_batch_size=5, seed=1), 5)) != list(epochs[0])


def test_validation_is_one_ordered_pass_per_iter(folder):
    data = loader(folder, local_batch_size=2, split="validation", shuffle=False)  # 80 tokens: 10 windows
    assert windows(data) == list(range(10)) and windows(data) == list(range(10))
    assert data.state_dict() == {"samples_consumed": 10}


def test_data_parallel_ranks_split_the_global_batch(folder):
    single = take(loader(folder, local_batch_size=4), 12)
    ranks = [take(loader(folder, local_batch_size=2, dp_rank=r, dp_size=2), 12) for r in range(2)]
    for step, batch in enumerate(single):
        assert sorted(windows([batch])) == sorted(windows([ranks[0][step], ranks[1][step]]))
        assert windows([batch])[0::2] == windows([ranks[0][step]])  # rank r takes g % dp_size == r


def test_state_counts_global_samples(folder):
    data = loader(folder, local_batch_size=2, dp_rank=1, dp_size=3)
    assert data.state_dict() == {"samples_consumed": 0}
    take(data, 4)
    assert data.state_dict() == {"samples_consumed": 24}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_is_exact(folder, num_workers):
    uninterrupted = take(loader(folder, num_workers=num_workers), 14)
    first = loader(folder, num_workers=num_workers)
    batches = iter(first)
    head = [next(batches) for _ in range(5)]  # workers have prefetched further
    state = first.state_dict()
    assert state == {"samples_consumed": 15}
    # Stop the first loader's workers (and their queue threads) before the next one forks its own,
    # as a restarted trainer would: forking while another loader's threads run can crash the child.
    del batches, first
    gc.collect()
    resumed = loader(folder, num_workers=num_workers)
    resumed.load_state_dict(state)
    tail = take(resumed, 9)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, uninterrupted, strict=True))


def test_resume_under_another_data_parallel_degree(folder):
    reference = windows(take(loader(folder, local_batch_size=4), 10))
    first = loader(folder, local_batch_size=4)
    take(first, 3)
    state = first.state_dict()
    ranks = []
    for r in range(2):
        resumed = loader(folder, local_batch_size=2, dp_rank=r, dp_size=2)
        resumed.load_state_dict(state)
        ranks.append(take(resumed, 7))
    for step in range(7):
        assert sorted(reference[12 + 4 * step : 16 + 4 * step]) == sorted(windows([ranks[0][step], ranks[1][step]]))


def test_blend_is_deterministic_proportional_and_reads_each_folder(tmp_path):
    streams = [make_folder(tmp_path / "a", train_tokens=193)["train"],
               make_folder(tmp_path / "b", first_token=30000, train_tokens=377)["train"]]
    paths = [f"{tmp_path / 'a'}:3", f"{tmp_path / 'b'}:1"]
    samples = [s for batch in take(loader(paths, local_batch_size=100), 100) for s in batch]
    per_folder = [Counter(), Counter()]
    for sample in samples:
        d = int(sample[0] >= 30000)
        window = (int(sample[0]) - 30000 * d) // SEQ
        assert torch.equal(sample, streams[d][window * SEQ : window * SEQ + SEQ + 1])
        per_folder[d][window] += 1
    assert abs(sum(per_folder[0].values()) / len(samples) - 0.75) < 0.01
    # Each folder's own samples 0, 1, 2, ... : every window equally often, up to the epoch in progress.
    assert [max(c.values()) - min(c.values()) for c in per_folder] == [1, 1]
    assert [len(c) for c in per_folder] == [24, 47]
    again = take(loader(paths, local_batch_size=100), 3)
    first_batches = [torch.stack(samples[i * 100 : i * 100 + 100]) for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(again, first_batches))


def test_parse_path():
    assert parse_path("data/a:0.7") == ("data/a", 0.7)
    assert parse_path("data/a") == ("data/a", 1.0)
    assert parse_path("data/x:y") == ("data/x:y", 1.0)
    with pytest.raises(ValueError, match="training.dataset_path.*positive"):
        parse_path("data/a:0")


def test_errors_are_clear(folder, tmp_path):
    with pytest.raises(ValueError, match=f"training.dataset_path: {folder} was tokenized with"):
        build_packed_dataloader([folder], "train", str(ASSETS / "mistral_v1.model"), SEQ, 2, 0, 1, 0, 0)
    with pytest.raises(FileNotFoundError, match=f"training.dataset_path: {tmp_path} is not a packed dataset"):
        loader(str(tmp_path))
    with pytest.raises(ValueError, match="training.dataset_path: .*too few for one window"):
        build_packed_dataloader([folder], "train", TOKENIZER, 250, 2, 0, 1, 0, 0)
    with pytest.raises(ValueError, match="fewer than one batch"):
        loader(folder, local_batch_size=6, dp_size=2, split="validation", shuffle=False)
    with pytest.raises(ValueError, match="less than 1/1000"):
        loader([f"{folder}:1", f"{folder}:0.0001"])

"""The streaming hf loader (components/data/streaming.py): packing, data-parallel shares, loader workers,
exact resume, blends, validation and bad input."""

import json

import pytest
import torch

from components.data.streaming import (
    DataError,
    build_streaming_dataloader,
    build_streaming_validation_dataloader,
    open_source,
)


class ByteTokenizer:
    """Token = byte + 3, BOS 1, EOS 2: makes packed windows easy to read back. `seen` lists the texts it
    encoded (in this process)."""

    bos_id, eos_id, pad_id, vocab_size = 1, 2, 0, 259

    def __init__(self):
        self.seen = []

    def encode(self, text, bos=False, eos=False):
        self.seen.append(text)
        return [self.bos_id] * bos + [b + 3 for b in text.encode()] + [self.eos_id] * eos

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i > 2).decode()


DOCS = ["first document", "a second, longer document of text", "3", "the fourth and last one"]


def write_jsonl(path, docs=DOCS):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_repository(folder, docs, shards=4, split="train"):
    """A local dataset repository as the hub serves one: Parquet shards under data/, named by split."""
    import datasets

    (folder / "data").mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // shards)
    for i in range(shards):
        datasets.Dataset.from_dict({"text": docs[i * per:(i + 1) * per]}).to_parquet(
            str(folder / "data" / f"{split}-{i:05d}-of-{shards:05d}.parquet"))
    return folder


def stream(docs=DOCS, epochs=3):
    tok = ByteTokenizer()
    return [t for _ in range(epochs) for d in docs for t in tok.encode(d, bos=True, eos=True)]


def batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def loader_of(paths, seq_len, local_batch_size, dp_rank=0, dp_size=1, workers=0, tokenizer=None):
    return build_streaming_dataloader([str(p) for p in paths], "text", tokenizer or ByteTokenizer(), seq_len,
                                      local_batch_size, dp_rank, dp_size, workers)


@pytest.fixture(scope="module")
def corpus_repository(tmp_path_factory):
    """The first 400 documents of the shipped corpus as a 4-shard repository."""
    from conftest import CORPUS

    docs = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:400]]
    return write_repository(tmp_path_factory.mktemp("repo"), docs), docs


def test_windows_are_the_packed_document_stream(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl")
    got = torch.cat([b.flatten() for b in batches(loader_of([path], 9, 2), 6)]).tolist()
    assert got == stream()[: 6 * 2 * 10]  # 6 batches of 2 windows of seq_len + 1 tokens, across epochs
    assert got[0] == 1 and ByteTokenizer().decode(got[:10]) == "first doc"


def test_one_shard_is_shared_by_document_and_no_document_is_read_twice(tmp_path):
    docs = [f"document number {i}" for i in range(10)]
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    tokenizers = [ByteTokenizer(), ByteTokenizer()]
    for rank in range(2):
        got = torch.cat([b.flatten() for b in batches(loader_of([path], 9, 1, rank, 2, tokenizer=tokenizers[rank]),
                                                      12)]).tolist()
        assert got == stream(docs[rank::2], 2)[:120]  # the rank packs its own documents, in order
    first_epoch = [t.seen[:5] for t in tokenizers]
    assert first_epoch == [docs[0::2], docs[1::2]]


def test_shards_are_shared_whole_and_each_rank_tokenizes_half(corpus_repository):
    folder, docs = corpus_repository
    seen = []
    for rank in range(2):
        tokenizer = ByteTokenizer()
        loader = loader_of([folder], 63, 4, rank, 2, tokenizer=tokenizer)
        it = iter(loader)
        while len(tokenizer.seen) < 200 + 1:  # past one pass over this rank's 200 documents
            next(it)
        seen.append(tokenizer.seen[:200])
    # Rank r reads shards r and r + 2 of 4: half the documents each, none twice.
    assert seen == [docs[:100] + docs[200:300], docs[100:200] + docs[300:]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_loader_continues_bitwise(corpus_repository, workers):
    folder, _ = corpus_repository
    straight = batches(loader_of([folder], 63, 4, workers=workers), 16)
    first = loader_of([folder], 63, 4, workers=workers)
    head = batches(first, 8)
    resumed = loader_of([folder], 63, 4, workers=workers)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(straight, head + batches(resumed, 8)))
    assert resumed.tokens_by_source == {folder.name: 16 * 4 * 64}


def test_a_resume_under_another_layout_is_refused_by_the_loader(corpus_repository):
    folder, _ = corpus_repository
    first = loader_of([folder], 63, 4)
    batches(first, 2)
    other = loader_of([folder], 63, 4, workers=2)
    with pytest.raises(DataError, match="saved with"):
        other.load_state_dict(first.state_dict())


def test_loader_workers_take_the_shards_of_their_rank(corpus_repository):
    folder, docs = corpus_repository
    first, second = batches(loader_of([folder], 63, 4, 1, 2, workers=2), 2)
    # Rank 1 of 2 reads shards 2 and 4 (documents 100-199 and 300-399); its two workers take one each
    # and hand out batches in turn.
    for batch, document in ((first, docs[100]), (second, docs[300])):
        assert batch[0, 0] == 1 and ByteTokenizer().decode(batch[0, 1:].tolist()).startswith(document[:20])


def test_a_blend_holds_its_token_proportions(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [f"alpha {i} " * 3 for i in range(50)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"b{i}" for i in range(50)])
    loader = build_streaming_dataloader([f"{a}:0.75", f"{b}:0.25"], "text", ByteTokenizer(), 31, 4, 0, 1, 0)
    batches(loader, 25)
    tokens = loader.tokens_by_source
    assert sum(tokens.values()) == 25 * 4 * 32
    assert abs(tokens["a"] / sum(tokens.values()) - 0.75) < 0.02


def test_validation_gives_every_rank_the_same_number_of_whole_batches(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [f"doc {i} " * 5 for i in range(23)])
    counts = [len(list(build_streaming_validation_dataloader(str(path), "text", ByteTokenizer(), 9, 2, r, 3)))
              for r in range(3)]
    assert counts[0] == counts[1] == counts[2] > 0
    single = torch.cat(list(build_streaming_validation_dataloader(str(path), "text", ByteTokenizer(), 9, 6, 0, 1)))
    ranks = [torch.cat(list(build_streaming_validation_dataloader(str(path), "text", ByteTokenizer(), 9, 2, r, 3)))
             for r in range(3)]
    assert torch.equal(ranks[1][:2], single[[1, 4]])  # window g goes to rank g % 3


def test_files_folders_repositories_and_saved_datasets_are_read(tmp_path):
    import datasets

    def texts(path, field="text"):
        return [row[field] for row in open_source(str(path), field).dataset]

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("one file\nis one document\n")
    (tmp_path / "txt" / "b.txt").write_text("another")
    assert texts(tmp_path / "txt") == ["one file\nis one document\n", "another"]
    datasets.Dataset.from_dict({"content": DOCS}).to_parquet(str(tmp_path / "d.parquet"))
    assert texts(tmp_path / "d.parquet", "content") == DOCS
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    assert texts(tmp_path / "saved") == DOCS
    repo = write_repository(tmp_path / "repo", DOCS, shards=2)
    write_repository(repo, ["held out"], shards=1, split="validation")
    assert texts(repo) == DOCS and open_source(str(repo), "text").num_shards == 2


def test_bad_data_gets_a_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no data files at"):
        open_source(str(tmp_path / "missing.jsonl"), "text")
    with pytest.raises(DataError, match=r"has no field 'body' \(columns: text, id\)"):
        open_source(str(write_jsonl(tmp_path / "ok.jsonl")), "body")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="cannot read .*broken.parquet"):
        open_source(str(broken), "text")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n{"text": "fine"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        batches(loader_of([bad], 9, 1), 3)


def test_a_hub_id_while_offline_names_the_dataset(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"'allenai/c4:en' is not a local path.*this machine is offline"):
        open_source("allenai/c4:en", "text")


def test_a_resume_on_other_sources_reads_them_from_their_beginning(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl")
    b = write_jsonl(tmp_path / "b.jsonl", [f"other {i}" for i in range(5)])
    first = loader_of([a], 9, 2)
    batches(first, 3)
    other = loader_of([b], 9, 2)
    other.load_state_dict(first.state_dict())
    assert torch.equal(batches(other, 2)[0], batches(loader_of([b], 9, 2), 1)[0])
    assert other.tokens_by_source == {"b": 2 * 2 * 10}

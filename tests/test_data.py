"""The streaming hf loader (components/data/streaming.py, sources.py): one stream per sequence of the global
batch, the same global batches under every layout, each rank reading its own share, loader workers, exact
resume on another number of processes, reshuffled epochs, blends, validation and bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.data.sources import DataError, open_source, reader_libraries
from components.data.streaming import build_streaming_dataloader, build_streaming_validation_dataloader


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


def packed(docs):
    tok = ByteTokenizer()
    return [t for d in docs for t in tok.encode(d, bos=True, eos=True)]


def loader_of(paths, seq_len, local_batch, global_batch=None, dp_rank=0, dp=1, workers=0, tokenizer=None, seed=42):
    return build_streaming_dataloader([str(p) for p in paths], "text", tokenizer or ByteTokenizer(), seq_len,
                                      local_batch, global_batch or local_batch * dp, dp_rank, dp, workers, seed)


def global_batches(paths, steps, seq_len, global_batch, dp=1, accumulation=1, workers=0, states=None, seed=42):
    """The windows of each step as the ranks of a layout read them, sorted (a step's windows are a set: which
    rank computes which does not change the step), and the loaders' states at the end."""
    local = global_batch // (dp * accumulation)
    loaders = [loader_of(paths, seq_len, local, global_batch, r, dp, workers, seed=seed) for r in range(dp)]
    for loader in loaders:
        if states:
            loader.load_state_dict(states)
    iterators = [iter(loader) for loader in loaders]
    steps_read = []
    for _ in range(steps):
        rows = [row for _ in range(accumulation) for it in iterators for row in next(it).tolist()]
        steps_read.append(sorted(rows))
    state = {}
    for loader in loaders:
        state |= loader.state_dict()
        loader.close()
    return steps_read, state


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 400 documents of the shipped corpus, as one JSON-lines file."""
    from conftest import CORPUS

    folder = tmp_path_factory.mktemp("corpus")
    (folder / "docs.jsonl").write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:400]))
    return folder / "docs.jsonl"


def test_one_stream_is_the_packed_document_stream_in_file_order(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl")
    batches = iter(loader_of([path], 9, 1))
    got = [t for _ in range(9) for t in next(batches).flatten().tolist()]
    assert got[:len(packed(DOCS))] == packed(DOCS)  # the first pass: every document once, in file order
    assert ByteTokenizer().decode(got[:10]) == "first doc"


@pytest.mark.parametrize("dp, accumulation, workers", [(2, 1, 2), (4, 1, 1), (2, 2, 0), (1, 4, 2)])
def test_every_layout_of_a_global_batch_reads_the_same_global_batches(corpus, dp, accumulation, workers):
    """The order belongs to the run: 1 process without workers against FSDP 2 and 4, gradient accumulation and
    loader workers, over more than one pass of the data (the shipped corpus's 400 documents, 88k tokens)."""
    alone, _ = global_batches([corpus], 24, 511, 8)
    assert global_batches([corpus], 24, 511, 8, dp, accumulation, workers)[0] == alone


def test_a_stream_reads_its_share_and_a_rank_its_streams(corpus):
    """Streams split the documents without overlap; rank r of 2 reads (and tokenizes) the streams r, r + 2, ...:
    half the bytes, half the documents."""
    source = open_source(str(corpus), "text")
    shares = [source.share(v, 8) for v in range(8)]
    assert shares[0][0] == 0 and shares[-1][1] == source.units and all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    documents = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    per_stream = [source.read_range(*share) for share in shares]
    assert [d for texts in per_stream for d in texts] == documents
    seen = []
    for rank in range(2):
        tokenizer = ByteTokenizer()
        loader = loader_of([corpus], 63, 4, 8, rank, 2, tokenizer=tokenizer)
        batches = iter(loader)
        while len(set(tokenizer.seen)) < sum(len(per_stream[v]) for v in range(rank, 8, 2)):
            next(batches)
        seen.append(set(tokenizer.seen))
    assert seen == [{d for v in range(r, 8, 2) for d in per_stream[v]} for r in range(2)]
    assert {len(s) for s in seen} == {200}
    read = [sum(shares[v][1] - shares[v][0] for v in range(r, 8, 2)) / source.units for r in range(2)]
    assert read == pytest.approx([0.5, 0.5], abs=0.01)


def test_a_loader_resumed_on_another_number_of_processes_continues_the_stream(corpus):
    """2 processes, then 1, then 4 (with loader workers): the global batches of one uninterrupted run."""
    straight, _ = global_batches([corpus], 30, 511, 8)
    first, state = global_batches([corpus], 10, 511, 8, dp=2, workers=2)
    second, state = global_batches([corpus], 10, 511, 8, dp=1, states=state)
    third, _ = global_batches([corpus], 10, 511, 8, dp=4, workers=1, states=state)
    assert first + second + third == straight


def test_later_epochs_are_reshuffled_alike_under_every_layout_and_by_the_seed(tmp_path):
    docs = [f"document {i:03d} " + "x" * (i % 7) for i in range(64)]
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    tokenizer = ByteTokenizer()
    loader = loader_of([path], 4096, 1, tokenizer=tokenizer)
    batches = iter(loader)
    while len(tokenizer.seen) < 3 * len(docs):
        next(batches)
    epochs = [tokenizer.seen[i * len(docs):(i + 1) * len(docs)] for i in range(3)]
    assert epochs[0] == docs and sorted(epochs[1]) == sorted(docs) and epochs[1] != docs and epochs[2] != epochs[1]
    assert global_batches([path], 12, 63, 4, dp=2)[0] == global_batches([path], 12, 63, 4)[0]
    assert global_batches([path], 12, 63, 4, seed=7)[0] != global_batches([path], 12, 63, 4)[0]


def test_a_blend_holds_its_token_proportions(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [f"alpha {i} " * 3 for i in range(50)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"b{i}" for i in range(50)])
    loader = build_streaming_dataloader([f"{a}:0.75", f"{b}:0.25"], "text", ByteTokenizer(), 31, 4, 4, 0, 1, 0, 42)
    batches = iter(loader)
    for _ in range(25):
        next(batches)
    tokens = loader.tokens_by_source
    assert sum(tokens.values()) == 25 * 4 * 32
    assert abs(tokens["a"] / sum(tokens.values()) - 0.75) < 0.02
    blend = [f"{a}:0.75", f"{b}:0.25"]
    one = build_streaming_dataloader(blend, "text", ByteTokenizer(), 31, 4, 4, 0, 1, 0, 42)
    two = [build_streaming_dataloader(blend, "text", ByteTokenizer(), 31, 2, 4, r, 2, 0, 42) for r in range(2)]
    rows = [sorted(torch.cat([next(iter(loader)) for loader in two]).tolist()), sorted(next(iter(one)).tolist())]
    assert rows[0] == rows[1]


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
        source = open_source(str(path), field)
        return source.read_range(0, source.units)

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
    assert texts(repo) == DOCS and len(open_source(str(repo), "text").files) == 2
    import gzip

    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    compressed = open_source(str(tmp_path / "docs.jsonl.gz"), "text")
    assert not compressed.splittable and texts(tmp_path / "docs.jsonl.gz") == DOCS
    two = [loader_of([tmp_path / "docs.jsonl.gz"], 4, 1, 2, r, 2) for r in range(2)]  # each takes every 2nd
    assert [ByteTokenizer().decode(next(iter(loader))[0].tolist()) for loader in two] == ["firs", "a se"]


def test_reader_libraries_names_what_reading_each_kind_of_source_imports(tmp_path):
    """The memory estimator's baseline imports reader_libraries: each kind of source read in a fresh process
    loads Hugging Face datasets and pyarrow exactly when it says (JSON lines: neither, the default data)."""
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    sources = [write_jsonl(tmp_path / "d.jsonl"), tmp_path / "d.parquet", tmp_path / "saved",
               write_repository(tmp_path / "repo", DOCS, shards=1)]
    read = ("import sys; from components.data.sources import open_source; s = open_source(sys.argv[1], 'text'); "
            "assert s.read_range(0, s.units); print([m for m in ('datasets', 'pyarrow') if m in sys.modules])")
    runs = [subprocess.Popen([sys.executable, "-c", read, str(path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parents[1]) for path in sources]
    loaded = [json.loads(run.communicate(timeout=120)[0].replace("'", '"')) for run in runs]
    assert [reader_libraries(str(path)) for path in sources] == [[], ["pyarrow.parquet"], ["datasets"], ["datasets"]]
    assert reader_libraries("allenai/c4:en:0.5") == ["datasets"]  # a hub id, with a blend weight
    assert loaded == [[], ["pyarrow"], ["datasets", "pyarrow"], ["datasets", "pyarrow"]]


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
        next(iter(loader_of([bad], 9, 1)))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty.jsonl' holds no documents \(its 1 file\(s\) are empty\)"):
        open_source(str(tmp_path / "empty.jsonl"), "text")
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", "  ", ""])
    with pytest.raises(DataError, match="blank is too small for 1 streams .* stream 0's share holds no document"):
        next(iter(loader_of([blank], 9, 1)))
    with pytest.raises(DataError, match="blank is too small for 8 streams"):
        next(iter(loader_of([write_jsonl(tmp_path / "blank.jsonl", ["a", "b"])], 9, 8)))


def test_a_hub_id_while_offline_names_the_dataset(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"'allenai/c4:en' is not a local path.*this machine is offline"):
        open_source("allenai/c4:en", "text")


def test_a_resume_on_other_sources_reads_them_from_their_beginning(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl")
    b = write_jsonl(tmp_path / "b.jsonl", [f"other {i}" for i in range(5)])
    first = loader_of([a], 9, 2)
    batches = iter(first)
    for _ in range(3):
        next(batches)
    other = loader_of([b], 9, 2)
    other.load_state_dict(first.state_dict())
    assert torch.equal(next(iter(other)), next(iter(loader_of([b], 9, 2))))
    assert other.tokens_by_source == {"b": 2 * 10}

import json

import pytest
import torch

from components.data.local_files import build_local_files_dataloader, load_documents


class ByteTokenizer:
    """Token = byte + 3, BOS 1, EOS 2: makes packed windows easy to read back."""

    bos_id, eos_id, pad_id, vocab_size = 1, 2, 0, 259

    def encode(self, text, bos=False, eos=False):
        return [self.bos_id] * bos + [b + 3 for b in text.encode()] + [self.eos_id] * eos

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i > 2).decode()


DOCS = ["first document", "a second, longer document of text", "3", "the fourth and last one"]


def write_jsonl(path, docs=DOCS):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def stream(docs=DOCS, epochs=3):
    tok = ByteTokenizer()
    return [t for _ in range(epochs) for d in docs for t in tok.encode(d, bos=True, eos=True)]


def batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def byte_loader(path, seq_len, local_batch_size, dp_rank=0, dp_size=1):
    """The loader of one JSON-lines file, tokenized by ByteTokenizer."""
    return build_local_files_dataloader([str(path)], "text", ByteTokenizer(), seq_len, local_batch_size, dp_rank,
                                        dp_size)


def test_windows_are_the_packed_document_stream(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl")
    loader = byte_loader(path, seq_len=9, local_batch_size=2)
    got = torch.cat([b.flatten() for b in batches(loader, 6)]).tolist()
    assert got == stream()[: 6 * 2 * 10]  # 6 batches of 2 windows of seq_len + 1 tokens, across epochs
    assert got[0] == 1 and ByteTokenizer().decode(got[:10]) == "first doc"


def test_data_parallel_ranks_take_interleaved_windows(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl")
    single = batches(byte_loader(path, 7, 4), 3)
    per_rank = [batches(byte_loader(path, 7, 2, r, 2), 3) for r in range(2)]
    for step in range(3):
        windows = single[step]
        assert torch.equal(per_rank[0][step], windows[0::2]) and torch.equal(per_rank[1][step], windows[1::2])


@pytest.mark.parametrize("resume_dp_size", [1, 2, 4])
def test_resume_continues_the_global_stream_under_any_dp_degree(tmp_path, resume_dp_size):
    path = write_jsonl(tmp_path / "docs.jsonl")
    reference = torch.cat(batches(byte_loader(path, 5, 4), 7))  # 7 global batches of 4 windows
    loaders = [byte_loader(path, 5, 2, r, 2) for r in range(2)]
    iters = [iter(loader) for loader in loaders]
    for _ in range(3):
        for it in iters:
            next(it)
    states = [loader.state_dict() for loader in loaders]
    assert states[0] == states[1]  # the position is global, the same on every rank
    resumed = [byte_loader(path, 5, 4 // resume_dp_size, r, resume_dp_size) for r in range(resume_dp_size)]
    for loader in resumed:
        loader.load_state_dict(states[0])
    got = [batches(loader, 4) for loader in resumed]
    for step in range(4):
        rows = torch.stack([w for r in range(resume_dp_size) for w in got[r][step]])
        order = [i * resume_dp_size + r for r in range(resume_dp_size) for i in range(4 // resume_dp_size)]
        global_batch = torch.empty_like(rows)
        global_batch[order] = rows
        assert torch.equal(global_batch, reference[(3 + step) * 4 : (4 + step) * 4])


def test_text_and_parquet_files(tmp_path):
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("one file\nis one document\n")
    (tmp_path / "txt" / "b.txt").write_text("another")
    assert load_documents([str(tmp_path / "txt")], "text")["text"] == ["one file\nis one document\n", "another"]
    import datasets

    datasets.Dataset.from_dict({"content": DOCS}).to_parquet(str(tmp_path / "d.parquet"))
    assert load_documents([str(tmp_path / "d.parquet")], "content")["content"] == DOCS
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    assert load_documents([str(tmp_path / "saved")], "text")["text"] == DOCS
    both = load_documents([str(tmp_path / "saved"), str(tmp_path / "txt")], "text")["text"]
    assert both == [*DOCS, "one file\nis one document\n", "another"]


def test_bad_data_gets_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no data files at"):
        load_documents([str(tmp_path / "missing.jsonl")], "text")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n{"text": "fine"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_documents([str(bad)], "text")
    with pytest.raises(ValueError, match=r"has no field 'body' \(columns: text, id\)"):
        load_documents([str(write_jsonl(tmp_path / "ok.jsonl"))], "body")

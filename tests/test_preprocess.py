"""The preprocessing CLI (scripts/preprocess): packed output, determinism, bad lines, inputs."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from components.data.packed_format import PackedSplit, ShardWriter, file_sha256, read_manifest
from components.data.tokenizer import build_tokenizer
from scripts.preprocess import main
from scripts.preprocess.split import validation_mask
from scripts.preprocess.workers import Encoder

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = str(REPO / "tests/assets/tokenizers/shakespeare_bpe_4k.model")
TIKTOKEN = str(REPO / "tests/assets/tokenizers/gpt2.tiktoken")
TRAIN = REPO / "tests/assets/shakespeare/train.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Short documents (slices of the shipped plays) so that tests tokenize little."""
    with TRAIN.open() as f:
        plays = [json.loads(line)["text"] for _, line in zip(range(100), f)]
    pieces = [play[200 * (i % 7) : 200 * (i % 7) + 300 + 37 * i] for i, play in enumerate(plays)]
    return [p for p in pieces if p.strip()][:60]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def run(*argv, tokenizer: str = TOKENIZER) -> int:
    """The CLI in this process, tokenizing in the main process (--workers 0) for speed."""
    return main([*map(str, argv), "--tokenizer", tokenizer, "--workers", "0", "--quiet"])


def documents(folder: Path, split: str = "train") -> list[list[int]]:
    packed = PackedSplit(folder, split)
    return [packed.document(i).tolist() for i in range(packed.num_documents)]


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_output_is_byte_identical_whatever_the_number_of_workers(tmp_path):
    outputs = []
    for workers in (1, 3):
        out = tmp_path / f"out-{workers}"
        code = main([str(TRAIN), "--output", str(out), "--tokenizer", TOKENIZER, "--workers", str(workers),
                     "--shard-tokens", "200000", "--batch-bytes", "200000", "--val-fraction", "0.05", "--quiet"])
        assert code == 0
        outputs.append(folder_bytes(out))
    assert outputs[0] == outputs[1]
    names = sorted(outputs[0])
    assert sum(n.startswith("train-") and n.endswith(".bin") for n in names) >= 5
    assert "validation-00000.bin" in names and "manifest.json" in names
    manifest = json.loads(outputs[0]["manifest.json"])
    assert "workers" not in json.dumps(manifest)
    assert manifest["counts"]["documents"] == 1151


def test_bad_lines_are_skipped_counted_and_located(tmp_path, tokenizer, texts, capsys):
    good = texts[:30]
    bad = {  # line number -> (content, reason)
        3: (b"", "empty_line"),
        6: (b"   ", "empty_line"),
        9: (b'{"text": "unterminated', "invalid_json"),
        12: (b'{"title": "no text here"}', "missing_field"),
        15: (b'{"text": 42}', "not_a_string"),
        18: (b'{"text": null}', "null_text"),
        21: (b'{"text": " "}', "empty_text"),
        24: (b"[1, 2, 3]", "not_an_object"),
        27: (b'{"text": "caf\xe9"}', "invalid_utf8"),
        30: (b'{"text": "lone \\ud800 surrogate"}', "encode_error"),  # sentencepiece refuses it
    }
    lines, remaining = [], iter(good)
    for number in range(1, len(good) + len(bad) + 1):
        lines.append(bad[number][0] if number in bad else json.dumps({"text": next(remaining), "id": number}).encode())
    path = tmp_path / "mixed.jsonl"
    # CRLF on one line and no newline after the last one: both are still whole documents.
    path.write_bytes(b"\n".join(lines[:-1]) + b"\r\n" + lines[-1])
    shown = str(path)

    out = tmp_path / "out"
    assert run(path, "--output", out, "--val-fraction", "0") == 1
    err = capsys.readouterr().err
    assert "more than --max-bad-fraction" in err and "10 of 40 lines" in err
    manifest = read_manifest(out)  # written completely despite the failure
    assert documents(out) == [tokenizer.encode(t, bos=True, eos=True) for t in good]
    counts = manifest["counts"]
    assert (counts["lines"], counts["documents"]) == (40, 30)
    assert counts["tokens"] == sum(len(tokenizer.encode(t)) + 2 for t in good)
    assert counts["skipped"]["total"] == 10 and counts["skipped"]["lines_not_listed"] == 0
    assert counts["skipped"]["reasons"] == {"empty_line": 2, "invalid_json": 1, "missing_field": 1, "not_a_string": 1,
                                            "null_text": 1, "empty_text": 1, "not_an_object": 1, "invalid_utf8": 1,
                                            "encode_error": 1}
    assert counts["skipped"]["lines"] == [{"file": shown, "line": n, "reason": r} for n, (_, r) in sorted(bad.items())]

    before = folder_bytes(out)
    assert run(path, "--output", out, "--val-fraction", "0", "--max-bad-fraction", "0.25") == 0
    assert "error" not in capsys.readouterr().err
    assert folder_bytes(out) == before


def test_the_manifest_lists_at_most_1000_bad_lines(tmp_path, texts):
    path = tmp_path / "sparse.jsonl"
    path.write_text("\n" * 1200 + "".join(json.dumps({"text": t}) + "\n" for t in texts[:3]))
    out = tmp_path / "out"
    assert run(path, "--output", out, "--val-fraction", "0") == 1
    skipped = read_manifest(out)["counts"]["skipped"]
    assert skipped["total"] == 1200 and skipped["reasons"] == {"empty_line": 1200}
    assert len(skipped["lines"]) == 1000 and skipped["lines_not_listed"] == 200
    assert [r["line"] for r in skipped["lines"][:3]] == [1, 2, 3]
    assert PackedSplit(out).num_documents == 3


def test_index_round_trip_and_checksums(tmp_path, tokenizer, texts):
    out = tmp_path / "out"
    assert run(write_jsonl(tmp_path / "docs.jsonl", texts[:40]), "--output", out, "--val-fraction", "0",
               "--shard-tokens", "1500", "--batch-bytes", "3000") == 0
    manifest = read_manifest(out)
    expected = [tokenizer.encode(t, bos=True, eos=True) for t in texts[:40]]
    packed = PackedSplit(out, "train")
    assert [packed.document(i).tolist() for i in range(packed.num_documents)] == expected
    stream = np.concatenate([np.array(d) for d in expected])
    assert packed.num_tokens == len(stream) == manifest["splits"]["train"]["tokens"] == manifest["counts"]["tokens"]
    assert packed.read(1000, 3000).tolist() == stream[1000:4000].tolist()  # across shard boundaries

    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) >= 3
    assert sum(s["documents"] for s in shards) == manifest["splits"]["train"]["documents"] == 40
    for shard in shards:
        idx = np.fromfile(out / f"{shard['name']}.idx", dtype="<i8")
        assert len(idx) == shard["documents"] + 1 and idx[0] == 0 and idx[-1] == shard["tokens"]
        assert np.all(np.diff(idx) > 2)
        assert (out / f"{shard['name']}.bin").stat().st_size == shard["tokens"] * 2
        assert shard["sha256"] == {ext: file_sha256(out / f"{shard['name']}.{ext}") for ext in ("bin", "idx")}
    assert manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["path"] == TOKENIZER and manifest["tokenizer"]["fingerprint"].startswith("sha256:")
    assert (manifest["tokenizer"]["bos_id"], manifest["tokenizer"]["eos_id"]) == (tokenizer.bos_id, tokenizer.eos_id)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json"] + [f"{s['name']}.{ext}" for s in shards for ext in ("bin", "idx")])


def test_split_adds_up_and_is_deterministic(tmp_path, tokenizer, texts):
    corpus = [f"Document {i}. {texts[i % len(texts)][:80]}" for i in range(200)]
    path = write_jsonl(tmp_path / "docs.jsonl", corpus)
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        assert run(path, "--output", tmp_path / name, "--val-fraction", "0.2", "--seed", seed) == 0
        runs[name] = read_manifest(tmp_path / name)
    assert folder_bytes(tmp_path / "a") == folder_bytes(tmp_path / "b")

    splits = runs["a"]["splits"]
    assert splits["train"]["documents"] + splits["validation"]["documents"] == 200
    assert splits["train"]["tokens"] + splits["validation"]["tokens"] == runs["a"]["counts"]["tokens"]
    assert 20 <= splits["validation"]["documents"] <= 60
    is_val = validation_mask(7, 0, 0, 200, 0.2)  # file 0, its documents 0 .. 199
    assert np.array_equal(is_val, np.concatenate([validation_mask(7, 0, 0, 77, 0.2),
                                                  validation_mask(7, 0, 77, 123, 0.2)]))
    encoded = [tokenizer.encode(t, bos=True, eos=True) for t in corpus]
    assert documents(tmp_path / "a", "validation") == [e for e, v in zip(encoded, is_val) if v]
    assert documents(tmp_path / "a", "train") == [e for e, v in zip(encoded, is_val) if not v]
    assert documents(tmp_path / "c", "validation") != documents(tmp_path / "a", "validation")

    assert run(path, "--output", tmp_path / "none", "--val-fraction", "0") == 0
    manifest = read_manifest(tmp_path / "none")
    assert manifest["splits"]["validation"] == {"documents": 0, "tokens": 0, "shards": []}
    assert manifest["splits"]["train"]["documents"] == 200
    with pytest.raises(ValueError, match="no validation documents"):
        PackedSplit(tmp_path / "none", "validation")


@pytest.mark.slow
def test_parquet_text_gzip_glob_and_save_to_disk_inputs(tmp_path, tokenizer, texts):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(5)), "text": texts[0:5]}), tmp_path / "part.parquet", row_group_size=2)
    txt = tmp_path / "txt"
    (txt / "sub").mkdir(parents=True)
    for name, text in (("b.txt", texts[6]), ("a.txt", texts[5]), ("sub/c.txt", texts[7]), ("notes.md", "not read")):
        (txt / name).write_text(text)
    datasets.Dataset.from_dict({"text": texts[8:11], "n": [1, 2, 3]}).save_to_disk(str(tmp_path / "hf"))
    splits = {"train": datasets.Dataset.from_dict({"text": texts[11:13]}),
              "test": datasets.Dataset.from_dict({"text": texts[13:14]})}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "hfdict"))
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in texts[14:16]))
    (tmp_path / "glob").mkdir()
    write_jsonl(tmp_path / "glob" / "2.jsonl", texts[17:18])
    write_jsonl(tmp_path / "glob" / "1.jsonl", texts[16:17])

    inputs = [tmp_path / "part.parquet", txt, tmp_path / "hf", tmp_path / "hfdict", tmp_path / "docs.jsonl.gz",
              f"{tmp_path}/glob/*.jsonl"]
    out = tmp_path / "out"
    assert run(*inputs, "--output", out, "--val-fraction", "0") == 0
    assert documents(out) == [tokenizer.encode(t, bos=True, eos=True) for t in texts[:18]]
    manifest = read_manifest(out)
    assert manifest["inputs"] == [str(i) for i in inputs]
    assert manifest["files"] == [str(tmp_path / "part.parquet"), f"{txt}/a.txt", f"{txt}/b.txt", f"{txt}/sub/c.txt",
                                 str(tmp_path / "hf"), f"{tmp_path}/hfdict/train", f"{tmp_path}/hfdict/test",
                                 str(tmp_path / "docs.jsonl.gz"), f"{tmp_path}/glob/1.jsonl",
                                 f"{tmp_path}/glob/2.jsonl"]
    assert manifest["counts"]["lines"] == 18

    assert run(tmp_path / "part.parquet", "--output", tmp_path / "other", "--text-field", "body") == 2
    assert not (tmp_path / "other").exists()


def test_tiktoken_tokenizer(tmp_path, texts):
    tiktoken = build_tokenizer(TIKTOKEN)
    out = tmp_path / "out"
    path = write_jsonl(tmp_path / "docs.jsonl", texts[:5])
    assert run(path, "--output", out, "--val-fraction", "0", tokenizer=TIKTOKEN) == 0
    manifest = read_manifest(out)
    assert tiktoken.vocab_size > 50_000 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["vocab_size"] == tiktoken.vocab_size
    assert documents(out) == [tiktoken.encode(t, bos=True, eos=True) for t in texts[:5]]


def test_bad_inputs_are_refused_before_anything_is_written(tmp_path, texts, capsys):
    good = write_jsonl(tmp_path / "docs.jsonl", texts[:2])
    out = tmp_path / "out"
    for inputs, message in (
        ([good, tmp_path / "missing.jsonl"], "missing.jsonl: no such file or directory"),
        ([f"{tmp_path}/nothing-*.jsonl"], "no file matches this pattern"),
        ([tmp_path / "notes.csv"], "not a file type this tool reads"),
    ):
        if inputs[0] == tmp_path / "notes.csv":
            (tmp_path / "notes.csv").write_text("a,b\n")
        assert run(*inputs, "--output", out) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()

    (tmp_path / "corpus.jsonl.zst").write_bytes(b"")
    try:
        import zstandard  # noqa: F401
    except ImportError:
        assert run(tmp_path / "corpus.jsonl.zst", "--output", out) == 2
        assert "needs the zstandard module" in capsys.readouterr().err
        assert not out.exists()

    assert run(good, "--output", out, tokenizer=str(tmp_path / "nope.model")) == 2
    assert "nope.model" in capsys.readouterr().err and not out.exists()

    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert run(good, "--output", out) == 2
    assert "did not write (precious.txt)" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["precious.txt"]


def test_rerun_replaces_the_output_and_a_crash_leaves_no_manifest(tmp_path, texts, monkeypatch):
    path = write_jsonl(tmp_path / "docs.jsonl", texts[:20])
    out = tmp_path / "out"
    assert run(path, "--output", out, "--val-fraction", "0", "--shard-tokens", "500") == 0
    assert len(list(out.glob("train-*.bin"))) > 3
    # The input folder holds the earlier output: its manifest.json is not read as an input.
    path.rename(tmp_path / "data.jsonl")
    assert run(tmp_path, "--output", out, "--val-fraction", "0") == 0
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train-00000.bin", "train-00000.idx"]
    assert read_manifest(out)["files"] == [str(tmp_path / "data.jsonl")]
    path = tmp_path / "data.jsonl"

    def fail(self, document):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(ShardWriter, "write", fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        run(path, "--output", out, "--val-fraction", "0")
    assert not (out / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="not a packed dataset"):
        read_manifest(out)


@pytest.mark.slow
def test_command_line(tmp_path, texts):
    path = write_jsonl(tmp_path / "docs.jsonl", texts[:10])
    result = subprocess.run(
        [sys.executable, "-m", "scripts.preprocess", str(path), "--output", str(tmp_path / "out"),
         "--tokenizer", TOKENIZER, "--workers", "2", "--val-fraction", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "done: 10 documents" in result.stderr and "tokens/s" in result.stderr
    assert read_manifest(tmp_path / "out")["counts"]["documents"] == 10


def test_a_dead_worker_or_a_damaged_file_fails_cleanly(tmp_path, texts, monkeypatch, capsys):
    path = write_jsonl(tmp_path / "docs.jsonl", texts[:4])
    (tmp_path / "broken.jsonl.gz").write_bytes(b"this is not gzip data\n")
    out = tmp_path / "out"
    assert run(path, tmp_path / "broken.jsonl.gz", "--output", out) == 1
    assert "broken.jsonl.gz: reading failed" in capsys.readouterr().err
    assert not (out / "manifest.json").exists()

    if sys.platform != "linux":
        return  # the patch below reaches the workers only when they are forked
    monkeypatch.setattr(Encoder, "__call__", lambda self, parts: os._exit(3))  # inherited by forked workers
    assert main([str(path), "--output", str(out), "--tokenizer", TOKENIZER, "--workers", "1", "--quiet"]) == 1
    assert "a worker process died" in capsys.readouterr().err
    assert not (out / "manifest.json").exists()

"""Helpers to run the trainer from tests: in this process (fast) or under torchrun (several ranks)."""

import csv
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

# One intra-op thread per process, for the trainings run here and the processes they start: the suite runs two
# test processes on two cores, and a second thread per process only spins waiting for a core (in-process trainings
# measured 19% less CPU with one, at the same wall time on an idle machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Compiled code built in the process that compiles it: torch.compile otherwise starts a pool of as many compile
# workers as there are cores in every rank that compiles (each importing torch), which the tests' ranks share two
# cores with (a 4-rank compiled layout: 130 → 105 CPU-seconds with an empty compile cache).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests/assets/shakespeare/train.jsonl"
TOKENIZER = REPO / "tests/assets/tokenizers/shakespeare_bpe_4k.model"


def _packed_corpus_folder() -> Path:
    """Where the shipped corpus is preprocessed for the tests, named by what its contents depend on."""
    code = [REPO / "components/data/packed_format.py", *sorted((REPO / "scripts/preprocess").glob("*.py"))]
    inputs = [CORPUS, TOKENIZER, *code]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in inputs)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "ingot-tests" / f"shakespeare-packed-{digest}"


PACKED_CORPUS = _packed_corpus_folder()
"""The shipped corpus as a packed folder (built once per version of the preprocessing code, see
pytest_sessionstart): the packed loader's global stream is the same under every data-parallel layout,
which is what the parity tests compare."""

ON_HF = ["--training.dataset", "hf", "--training.dataset_path", str(CORPUS)]
"""The shipped corpus through the streaming hf loader (the default config's data): its first pass in file order
within each stream, whatever the seed; the same global batches under every layout."""

# A small but real configuration: the debug model's shape on the shipped corpus, cut for speed.
ON_PACKED = ["--training.dataset", "packed", "--training.dataset_path", str(PACKED_CORPUS)]
"""The shipped corpus through the packed loader: globally shuffled, the same global batches under every layout."""

TINY = [
    "--job.config_file", "debug_model.toml", *ON_PACKED, "--model.n_layers", "2", "--training.seq_len", "64",
    "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "false",
    "--metrics.enable_tensorboard", "false",
]


def tiny_model_args(**overrides):
    """A model small enough for exact comparisons in milliseconds."""
    from models.llama3.model import ModelArgs

    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32, multiple_of=32)
    return ModelArgs(**(args | overrides))


def build_model(args, seed: int = 0):
    """A model built on meta and initialized with `init_weights`, as train.py does on one CPU."""
    import torch

    from models.llama3.model import Transformer

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def metric_lines(dump: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl as written, repeats included (tests check what was
    written; components.metrics.reporting.read_metrics is the reader that keeps one record per step)."""
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def step_figures(dump: Path) -> dict[int, dict]:
    """step -> its training record (loss, grad_norm, the routing tally's figures, ...)."""
    return {m["step"]: m for m in metric_lines(dump) if "loss" in m}


def layout(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, ep=1, local_batch=None, extra=()) -> tuple[int, list[str]]:
    """(processes, arguments) of a layout at a global batch of 8: the local batch is 8 / dp unless given."""
    dp = dp_replicate * dp_shard
    return dp * tp * pp * cp, [
        "--parallelism.data_parallel_replicate_degree", str(dp_replicate),
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(pp),
        "--parallelism.context_parallel_degree", str(cp),
        "--parallelism.expert_parallel_degree", str(ep),
        "--training.local_batch_size", str(local_batch or 8 // dp),
        *extra,
    ]


SLIDING_WINDOW_PATCH = REPO / "docs" / "assets" / "fork_sliding_window.patch"


def sliding_window_fork(root: Path) -> str:
    """docs/models.md's sliding-window fork: models/llama3 copied to `root`/models/swa, its imports pointed at the
    copy, docs/assets/fork_sliding_window.patch applied. Returns the folder `import_fork` adds to the `models`
    package's path."""
    fork = root / "models" / "swa"
    shutil.copytree(REPO / "models" / "llama3", fork, ignore=shutil.ignore_patterns("__pycache__"))
    for path in fork.glob("*.py"):
        path.write_text(path.read_text().replace("models.llama3", "models.swa"))
    subprocess.run(["git", "apply", str(SLIDING_WINDOW_PATCH)], cwd=root, check=True)
    return str(root / "models")


RENAMES = {  # file of a family: (its text, the fork's); HF's own names (model.layers.N...) stay
    "model.py": [("tok_embeddings", "embed"), ("self.layers", "self.blocks")],
    "decoder.py": [("tok_embeddings", "embed"), ("self.layers", "self.blocks")],
    "parallelize.py": [("tok_embeddings", "embed"), ("model.layers", "model.blocks"), ('f"layers.{', 'f"blocks.{')],
    "hf_mapping.py": [("tok_embeddings", "embed"), ('blocks="layers"', 'blocks="blocks"'),
                      ('r"layers\\.', 'r"blocks\\.'), ('r"(layers\\.', 'r"(blocks\\.'), ('f"layers.{', 'f"blocks.{')],
}


def fork_with_renamed_modules(root: Path, family: str = "llama3", name: str = "renamed") -> Path:
    """models/<family> copied to `root`/models/<name>, its imports pointed at the copy, with `blocks` for `layers`
    and `embed` for `tok_embeddings` (declared through the model contract, components/model/contract.py, as its
    `transformer_blocks()` and `pipeline_ends`), in its Hugging Face mapping and tensor-parallel plan too. The
    decoder around the blocks is shared code (models/decoder.py), which the fork copies into its folder to rename
    its modules, as docs/models.md says a fork replaces a shared piece."""
    fork = root / "models" / name
    shutil.copytree(REPO / "models" / family, fork, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "models" / "decoder.py", fork / "decoder.py")
    for path in fork.glob("*.py"):
        text = path.read_text().replace(f"models.{family}", f"models.{name}")
        text = text.replace("from models.decoder import", f"from models.{name}.decoder import")
        for old, new in RENAMES.get(path.name, []):
            text = text.replace(old, new)
        path.write_text(text)
    return fork


def import_fork(models_folder: str):
    """The package models.swa from `models_folder` (`sliding_window_fork`)."""
    import importlib

    import models

    if models_folder not in models.__path__:
        models.__path__.append(models_folder)
    return importlib.import_module("models.swa")


def initial_weights(dump: Path) -> dict:
    """The weights of a run's step-1 checkpoint, trained at lr 0: its initial weights, whole."""
    import torch
    import torch.distributed.checkpoint as dcp

    from components.checkpoint.dcp import one_process, saved_entries

    step = dump / "checkpoint" / "step-1"
    names = {n.removeprefix("model."): e.size for n, e in saved_entries(step).items() if n.startswith("model.")}
    weights = {name: torch.empty(size) for name, size in names.items()}
    with one_process():
        dcp.load({"model": weights}, checkpoint_id=str(step), no_dist=True)
    return weights


def train_main(argv: list[str]) -> int:
    """train.main in this process (one rank): its exit status."""
    sys.path.insert(0, str(REPO))
    import train

    return train.main(argv)


def reference_runs(tmp_path_factory, base: list[str], sources: dict[str, list[str]]) -> dict[str, Path]:
    """Single-process runs of `base` (at a local batch of 8) on each data source, by name: the runs that the
    parity tests compare their layouts with."""
    dumps = {}
    for name, source in sources.items():
        dumps[name] = tmp_path_factory.mktemp(f"reference_{name}")
        assert train_main([*base, *source, "--training.local_batch_size", "8", "--job.dump_folder",
                           str(dumps[name])]) == 0
    return dumps


def losses(dump: Path) -> dict[int, float]:
    """step -> loss; a resumed run's later entries replace the earlier ones."""
    return {m["step"]: m["loss"] for m in metric_lines(dump) if "loss" in m}


def val_losses(dump: Path) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in metric_lines(dump) if "val_loss" in m}


@pytest.fixture
def train_in_process():
    return train_main


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the sweep runner launches anything; no GPUs (so no torch import either). Only the runner's
    own view of the subprocess module refuses: anything else may start processes (matplotlib's first import runs
    fc-list to build its font cache)."""
    from scripts.sweep import launch

    def refuse(*args, **kwargs):
        raise AssertionError(f"launched {args}")

    monkeypatch.setattr(launch, "subprocess", SimpleNamespace(**(vars(subprocess) | {"Popen": refuse})))
    monkeypatch.setattr(launch, "visible_gpus", lambda: [])


def on_ranks(fn, nprocs: int, *args) -> None:
    """fn(rank, *args) on `nprocs` processes; a failure on any rank fails the caller. They are forked from a
    fork server that imported torch once for this test process: mp.spawn's fresh interpreters import it again (3 to
    4 CPU-seconds a process), and a fork of the test process itself copies its threads' locks (pytest-xdist's, a
    thread pool's), which can hang the child. Children of the fork server, they are left out of the CPU that
    pytest_runtest_makereport gives each test."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.tensor"])
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def _torchrun_command(nproc: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(REPO / script), *args]


def torchrun(nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(_torchrun_command(nproc, "train.py", *args), cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def free_port() -> int:
    """A TCP port of this machine that nothing listens on now (a lighthouse's, a rendezvous')."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def torchrun_runs(runs: dict[str, tuple[int, list[str]]], folder: Path, timeout: int = 1800,
                  forks: Path | None = None) -> dict[str, tuple[Path, str]]:
    """Runs by name, each its number of processes and its train.py arguments, trained one after the other in one
    launch per number of processes (tests/train_runs.py): the layout tests' many tiny runs pay for starting Python and
    importing torch once. By name: the run's dump folder (in `folder`), and "" where every rank exited 0, else what
    went wrong and the run's output. `forks`: a folder holding models/<fork> folders the runs may name."""
    outcomes = {}
    for nproc in sorted({nproc for nproc, _ in runs.values()}):
        launch = {name: [*args, "--job.dump_folder", str(folder / name)] for name, (n, args) in runs.items()
                  if n == nproc}
        launched = _launch_runs(nproc, launch, timeout, forks)
        outcomes |= {name: (folder / name, problem) for name, problem in launched.items()}
    return outcomes


def _launch_runs(nproc: int, runs: dict[str, list[str]], timeout: int, forks: Path | None) -> dict[str, str]:
    from train_runs import RUN_START

    with tempfile.TemporaryDirectory() as scratch:
        runs_file, status_file = Path(scratch) / "runs.json", Path(scratch) / "status.jsonl"
        runs_file.write_text(json.dumps(runs))
        cmd = _torchrun_command(nproc, "tests/train_runs.py", str(runs_file), str(status_file))
        env = dict(os.environ, OMP_NUM_THREADS="1") | ({"PYTHONPATH": f"{forks}{os.pathsep}{REPO}"} if forks else {})
        try:
            output = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, timeout=timeout).stdout
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode() + f"\n[the launch timed out after {timeout} s]"
        statuses: dict[str, list[int]] = {}
        for line in status_file.read_text().splitlines() if status_file.exists() else []:
            record = json.loads(line)
            statuses.setdefault(record["run"], []).append(record["status"])
    own = dict(part.split("\n", 1) for part in output.split(RUN_START)[1:] if "\n" in part)
    problems = {}
    for name in runs:
        got = statuses.get(name, [])
        problems[name] = "" if len(got) == nproc and not any(got) else \
            f"exit statuses {got} of {nproc} ranks:\n{own.get(name, output)[-6000:]}"
    return problems


FIRST = ("test_docs_run_in_order.py", "test_docs_run_in_order_lane_2.py")
"""The two lanes of the documented commands, a third of the suite's time: first, one on each pytest-xdist worker, so
that the workers share them and then run the rest, rather than one waiting for them at the end."""


def pytest_sessionstart(session):
    """Build PACKED_CORPUS unless an earlier session did; built aside and renamed, so that concurrent
    sessions never read a half-written folder."""
    if (PACKED_CORPUS / "manifest.json").exists():
        return
    from scripts.preprocess import preprocess

    PACKED_CORPUS.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=PACKED_CORPUS.parent))
    preprocess([str(CORPUS)], str(staging / "out"), str(TOKENIZER), workers=0, val_fraction=0.0, progress=False)
    try:
        (staging / "out").rename(PACKED_CORPUS)
    except OSError:  # another session got there first
        pass
    shutil.rmtree(staging, ignore_errors=True)


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (theirs include their own children)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


CPU_AT_START = pytest.StashKey[float]()


def pytest_runtest_setup(item):
    item.stash[CPU_AT_START] = _cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's teardown report carries its CPU seconds, its processes' included, from setup to teardown: what the
    suite's time on a 2-core machine follows, where a wall time depends on what ran beside it."""
    report = yield
    if call.when == "teardown" and CPU_AT_START in item.stash:
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[CPU_AT_START]))
    return report


def pytest_terminal_summary(terminalreporter):
    """The 20 tests that used the most CPU, and the suite's total: after --durations' wall times."""
    spent = {r.nodeid: dict(r.user_properties)["cpu_seconds"] for reports in terminalreporter.stats.values()
             for r in reports if getattr(r, "when", None) == "teardown" and "cpu_seconds" in dict(r.user_properties)}
    if not spent:
        return
    terminalreporter.write_sep("=", f"most CPU (tests and their processes): {sum(spent.values()) / 60:.1f} CPU-min "
                                    f"in all, {len(spent)} tests")
    for nodeid, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")


def pytest_collection_modifyitems(config, items):
    """The FIRST test first; cuda-marked tests skip cleanly on a machine without a CUDA GPU."""
    import torch

    items.sort(key=lambda item: item.path.name not in FIRST)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

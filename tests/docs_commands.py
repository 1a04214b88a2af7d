"""Every shell command of README.md and docs/*.md, run as a reader types them, in order, in one scratch clone
of the repository: tests/test_docs_run_in_order.py, or by hand

    python tests/docs_commands.py [--repo DIR] [--report FILE]

which prints (or writes to FILE) one row per command: where, the command as run, exit status, seconds,
and the first and last line of its output, or why it was skipped.

The commands are the lines of the ```bash, ```sh and ```shell blocks of README.md, docs/getting_started.md,
then the other docs/*.md in alphabetical order. A line ending in `\\` or leaving a quote open goes on on the
next line; blank lines and lines starting with `#` are not commands. A command sent to the background
(ending in `&`) runs in one shell with the next command, which deals with it.

A command's trailing comment says what it must do (the convention docs/getting_started.md states):
- `# needs GPUs`, `# needs a cluster`, `# needs network` (any comment starting with `needs `): not run; the
  report lists it as skipped, with the comment as the reason;
- `# exits N`: exit status N and no Python traceback; a refusal (N = 2) in at most 15 lines of output;
- `# trains nothing...`: a training that finds its run finished; any other command that says "nothing
  trained" (a relaunch of a finished run, train.py's line) is not doing what its text says;
- any other command: exit status 0.

Each runs with bash in one scratch clone of the repository (the files git sees: tracked, and untracked but not
ignored), with this Python's bin/ first on PATH and OMP_NUM_THREADS=1. README.md and docs/getting_started.md run
first, in order; then the other documents, each whole and in order, several at once, the longest first: each
lane (a thread here, LANES of them; in the suite, one test on each pytest-xdist worker) takes the next document
nobody has taken (run_share). A command thus finds what README.md, getting_started.md and the earlier commands of
its own document wrote, as a reader who follows the README and then any page finds it; the documents keep to their own
dump folders (`shared_folders`, a test). The clone is deleted when every command did as documented.
Training commands run exactly as typed: the documents give their examples few steps and a folder of their own.
What the runner changes, and why:
- The install is not redone: the `python3 -m venv`, `. .venv/bin/activate` and `pip install` parts of a
  command (split at `&&`) are dropped and the rest runs in this environment; a command with nothing else
  is skipped.
- `python -m pytest` only collects the suite (`--collect-only -q`): running it would run this test again.
- Tools that train many runs, each in a folder of its own, run fewer and shorter ones, their documented
  runs taking minutes (TOOL_CUTS): the benchmark its baseline case only, for 3 steps; autotune 4 candidates
  (batch 4 or 8, AC none or full, no compile) of 2 steps, but as typed with `--predict` (it trains nothing);
  coord_check 2 steps; the CP attention and DeltaNet benchmarks 512 tokens at degrees 1 and 2; the fault soak 2
  faults (tests/test_soak.py throws every kind). In the clone, the
  sweep files (train_configs/sweeps/) keep the first value of each grid key and their first [[runs]], of 1 step each
  (tests/test_sweep.py runs the rest of what a sweep does); the ladder files (train_configs/ladders/) keep
  their first 2 rungs and the held-out ones (a fit needs 2 runs), their first token budget, a 32nd of each,
  with 2 warm-up steps and no bootstrap (losses this close to the initial ones give the resamples nothing to
  fit); both validate on 2 batches. Each cut changes how many runs a tool makes and how long, never what a
  run finds in its folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
FENCES = ("```bash", "```sh", "```shell")
STEPS = 1
"""The steps of each run of a cut sweep."""
VALIDATION_STEPS = 2
INSTALL = re.compile(r"(python3? -m venv|\. \.venv/bin/activate|pip install)\b")
TOOL_CUTS = {
    "scripts.benchmark": "--steps 3 --warmup 1 --cases 'debug default'",
    "scripts.autotune --predict": "",  # trains nothing: runs as typed
    "scripts.autotune": "--steps 2 --batch-sizes 4,8 --ac-modes none,full --compile off",
    "scripts.coord_check": "--steps 2",
    "scripts.benchmark.cp_attention_memory": "--seq 512 --degrees 1 2",
    "scripts.benchmark.cp_delta_net_memory": "--seq 512 --degrees 1 2",
    "scripts.soak": "--faults 2",
}
REFUSED, MAX_REFUSAL_LINES = 2, 15
TIMEOUT = 900  # seconds per command
TIMED_OUT = 124  # the status a timed-out command gets, as timeout(1) gives
FIRST = ("README.md", "docs/getting_started.md")
"""The documents every other one follows."""
LANES = 2
NOTHING_TRAINED = "nothing trained: the checkpoint in"
"""What train.py logs when a launch finds its run finished."""


@dataclass(frozen=True)
class Command:
    where: str
    """file:line of its first line."""
    text: str
    """As documented, continuation lines joined, without its trailing comment."""
    mark: str = ""
    """Its trailing comment."""

    @property
    def document(self) -> str:
        return self.where.rpartition(":")[0]

    @property
    def skip(self) -> str | None:
        return self.mark if self.mark.startswith("needs ") else None

    @property
    def expected(self) -> int:
        exits = re.match(r"exits (\d+)", self.mark)
        return int(exits[1]) if exits else 0


@dataclass(frozen=True)
class Outcome:
    command: Command
    ran: str | None = None
    """The command as run; None when skipped."""
    status: int | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """Of the command's processes: what the runner's time on a loaded machine follows."""
    output: str = ""
    problem: str = ""
    """Empty when the command did what its documentation says."""


def _unquoted(text: str) -> tuple[list[int], bool]:
    """The positions of `text`'s characters outside quotes and escapes, and whether a quote is left open."""
    positions, quote, escaped, comment = [], None, False, False
    for i, c in enumerate(text):
        if comment:  # a comment runs to the end of its line, quotes in it included
            comment = c != "\n"
            if not comment:
                positions.append(i)
        elif escaped:
            escaped = False
        elif c == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        else:
            comment = c == "#" and (i == 0 or text[i - 1].isspace())
            positions.append(i)
    return positions, quote is not None


def split_comment(text: str) -> tuple[str, str]:
    """(the command, its trailing comment)."""
    for i in _unquoted(text)[0]:
        if text[i] == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip(), text[i + 1:].strip()
    return text, ""


def documents(repo: Path) -> list[Path]:
    others = sorted(p for p in (repo / "docs").glob("*.md") if p.name != "getting_started.md")
    return [repo / "README.md", repo / "docs" / "getting_started.md", *others]


def read_commands(repo: Path) -> list[Command]:
    commands = []
    for doc in documents(repo):
        fenced, pending, start = False, None, 0
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced and line.strip() in FENCES
                continue
            if not fenced:
                continue
            if pending is None:
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                pending, start = line, number
            elif pending.endswith("\\"):
                pending = pending[:-1].rstrip() + " " + line.strip()
            else:  # a quote left open: the line break is part of the command
                pending += "\n" + line
            if pending.endswith("\\") or _unquoted(pending)[1]:
                continue
            command, pending = Command(f"{doc.relative_to(repo)}:{start}", *split_comment(pending)), None
            previous = commands[-1] if commands else None
            if previous and previous.text.endswith("&") and not previous.text.endswith("&&"):
                command = Command(commands.pop().where, f"{previous.text}\n{command.text}", command.mark)
            commands.append(command)
    return commands


def _segments(text: str) -> list[tuple[int, int]]:
    """(start, end) of each simple command of `text`, between unquoted `;`, `&`, `|` and line breaks."""
    bounds = [i for i in _unquoted(text)[0] if text[i] in ";&|\n"]
    return list(zip([0, *(i + 1 for i in bounds)], [*bounds, len(text)]))


def as_run(command: Command) -> str:
    """The command with the runner's changes (see the module's docstring); empty when nothing is left."""
    text = " && ".join(part for part in re.split(r"\s*&&\s*", command.text) if not INSTALL.match(part))
    text = text.replace("python -m pytest", "python -m pytest --collect-only -q")
    for start, end in reversed(_segments(text)):
        segment = text[start:end].rstrip()
        extra = next((flags for tool, flags in TOOL_CUTS.items() if f"-m {tool} " in f"{segment} "), "")
        if extra:
            text = f"{segment} {extra}".join((text[:start], text[start + len(segment):]))
    return text


def copy_repository(repo: Path, scratch: Path) -> None:
    """The files git sees, as they are in the working tree; sweeps and ladders cut short."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, names):
        if (repo / name).is_file():  # not a tracked file deleted in the working tree
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, scratch / name)
    for sweep in (scratch / "train_configs" / "sweeps").glob("*.toml"):
        data = tomllib.loads(sweep.read_text())
        data.setdefault("overrides", {}).update({"training.steps": STEPS, "validation.steps": VALIDATION_STEPS})
        if "grid" in data:
            data["grid"] = {key: values[:1] for key, values in data["grid"].items()}
        if "runs" in data:
            data["runs"] = data["runs"][:1]
        sweep.write_text(to_toml(data))
    for ladder in (scratch / "train_configs" / "ladders").glob("*.toml"):
        data = tomllib.loads(ladder.read_text())
        data["bootstrap"] = 0
        data.setdefault("overrides", {}).update({"lr_scheduler.warmup_steps": 2, "validation.steps": VALIDATION_STEPS})
        if "rungs" in data:
            held_out = set(data.get("holdout", []))
            data["rungs"] = [rung for i, rung in enumerate(data["rungs"]) if i < 2 or rung.get("name") in held_out]
        for table in (data, *data.get("rungs", [])):
            if "tokens" in table:
                table["tokens"] = [int(tokens) // 32 for tokens in table["tokens"][:1]]
        ladder.write_text(to_toml(data))


def to_toml(data: dict) -> str:
    """TOML for the shapes of sweep and ladder files: values, tables of values and arrays of such tables."""
    def value(v) -> str:
        if isinstance(v, list):
            return f"[{', '.join(map(value, v))}]"
        return json.dumps(v) if isinstance(v, (str, bool)) else repr(v)

    def table(values: dict) -> list[str]:
        return [f"{json.dumps(key)} = {value(v)}" for key, v in values.items()]

    lines = table({key: v for key, v in data.items() if not isinstance(v, dict) and not _tables(v)})
    for key, v in data.items():
        if isinstance(v, dict):
            lines += [f"[{key}]", *table(v)]
        elif _tables(v):
            for item in v:
                lines += [f"[[{key}]]", *table(item)]
    return "\n".join(lines) + "\n"


def _tables(v) -> bool:
    return isinstance(v, list) and bool(v) and isinstance(v[0], dict)


def check(command: Command, status: int, output: str) -> str:
    """What the command did against what its documentation says; empty when they agree."""
    if status != command.expected:
        return f"exit status {status}, documented {command.expected}"
    if command.expected and "Traceback" in output:
        return "a Python traceback"
    lines = len(output.splitlines())
    if command.expected == REFUSED and lines > MAX_REFUSAL_LINES:
        return f"refused in {lines} lines (at most {MAX_REFUSAL_LINES})"
    trained_nothing = next((line for line in output.splitlines() if NOTHING_TRAINED in line), None)
    if trained_nothing and not command.mark.startswith("trains nothing"):
        return f"trained nothing, its text not saying so: {trained_nothing.strip()}"
    return ""


def run(text: str, scratch: Path) -> tuple[int, str, float]:
    """Run `text` with bash in `scratch`; the exit status, the output (stdout and stderr) and the CPU seconds of
    bash and the processes it waited for (os.wait4's account of the one child)."""
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                        "OMP_NUM_THREADS": "1"}  # a lane's commands keep to a core: threads that wait for each
    # other on a busy machine crawl (docs/benchmarks.md)
    process = subprocess.Popen(["bash", "-c", text], cwd=scratch, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.append(process.stdout.read()), daemon=True)
    reader.start()
    try:
        reader.join(TIMEOUT)
        timed_out = reader.is_alive()  # bash itself may have ended, but something it started holds the output
        if timed_out:
            os.killpg(process.pid, signal.SIGKILL)
            reader.join()
            output.append(f"\n[timed out after {TIMEOUT} s]")
        _, status, usage = os.wait4(process.pid, 0)  # reaped here, with its account, rather than by Popen
    except BaseException:  # interrupted: leave no command running
        os.killpg(process.pid, signal.SIGKILL)
        raise
    process.returncode = os.waitstatus_to_exitcode(status)
    process.stdout.close()
    return TIMED_OUT if timed_out else process.returncode, "".join(output), usage.ru_utime + usage.ru_stime


def run_command(command: Command, scratch: Path) -> Outcome:
    ran = "" if command.skip else as_run(command)
    if not ran:
        return Outcome(command)
    start = time.perf_counter()
    status, output, cpu = run(ran, scratch)
    return Outcome(command, ran, status, time.perf_counter() - start, cpu, output, check(command, status, output))


def by_document(commands: list[Command]) -> dict[str, list[Command]]:
    """Each document's commands, the document with most commands to run first."""
    documents: dict[str, list[Command]] = {}
    for command in commands:
        documents.setdefault(command.document, []).append(command)
    return dict(sorted(documents.items(), key=lambda item: -sum(not c.skip for c in item[1])))


def _claim(scratch: Path, name: str) -> bool:
    """Whether this caller is the first to ask for `name` (a file created once, across processes)."""
    (scratch / "claims").mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(scratch / "claims" / name.replace("/", "_"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def run_share(repo: Path, scratch: Path, progress: Callable[[Outcome], None] = lambda outcome: None,
              first_timeout: float = 3600) -> list[Outcome]:
    """Run documents of `repo` in the clone `scratch`/clone that several lanes share, threads or processes (the
    pytest-xdist workers, tests/test_docs_run_in_order*.py), until none is left; the Outcomes of the commands this
    lane ran, in the documents' order. The first lane copies the repository and runs README.md and
    getting_started.md, the others wait for them; then each lane takes the next document nobody took yet, the
    longest first, and runs it whole. A lane ends when it finds none left."""
    clone, first_done = scratch / "clone", scratch / "first.done"
    outcomes: dict[Command, Outcome] = {}

    def run_in_order(document: list[Command]) -> None:
        for command in document:
            outcomes[command] = run_command(command, clone)
            progress(outcomes[command])

    if _claim(scratch, "first documents"):
        try:
            copy_repository(repo, clone)
            run_in_order([c for c in read_commands(clone) if c.document in FIRST])
        finally:
            first_done.touch()
    deadline = time.monotonic() + first_timeout
    while not first_done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"README.md and getting_started.md did not end in {first_timeout:.0f} s")
        time.sleep(1)
    if not clone.is_dir():  # every document was run, and the clone went, before this lane began
        return []
    commands = read_commands(clone)
    for name, document in by_document([c for c in commands if c.document not in FIRST]).items():
        if _claim(scratch, name):
            run_in_order(document)
    return [outcomes[c] for c in commands if c in outcomes]


def join_lanes(scratch: Path) -> Path:
    """Register a lane (its file in `scratch`/lanes), before it takes any document."""
    (scratch / "lanes").mkdir(parents=True, exist_ok=True)
    handle, path = tempfile.mkstemp(dir=scratch / "lanes")
    os.close(handle)
    return Path(path)


def leave_lanes(lane: Path, clean: bool) -> None:
    """A lane is done; the last one out deletes the clone when no lane found a problem (`clean`: this one's)."""
    scratch = lane.parent.parent
    if not clean:
        (scratch / "kept").touch()
    lane.unlink()
    if not any((scratch / "lanes").iterdir()) and not (scratch / "kept").exists():
        shutil.rmtree(scratch / "clone", ignore_errors=True)


def run_commands(repo: Path, scratch: Path, lanes: int = LANES,
                 progress: Callable[[Outcome], None] = lambda outcome: None, keep: bool = False) -> list[Outcome]:
    """Every documented command of `repo`, run by `lanes` threads (run_share) in `scratch`/clone; one Outcome each,
    in the documents' order. `progress` sees each as it ends. The clone goes when every command did as
    documented, unless `keep`."""
    joined = [join_lanes(scratch) for _ in range(lanes)]
    with ThreadPoolExecutor(lanes) as pool:
        shares = list(pool.map(lambda _: run_share(repo, scratch, progress), range(lanes)))
    outcomes = {o.command: o for share in shares for o in share}
    for lane in joined:
        leave_lanes(lane, clean=not keep and not any(o.problem for o in outcomes.values()))
    return [outcomes[c] for c in read_commands(repo) if c in outcomes] if outcomes else []


def shared_folders(commands: list[Command]) -> dict[str, list[str]]:
    """Dump folders (--job.dump_folder) that commands of two documents name, with the documents: documents after
    FIRST run at once in one clone, so each must keep to its own."""
    users: dict[str, set[str]] = {}
    for command in commands:
        for folder in re.findall(r"--job\.dump_folder[ =](\S+)", command.text):
            users.setdefault(folder, set()).add(command.document)
    return {folder: sorted(documents) for folder, documents in users.items() if len(documents) > 1}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def report(outcomes: list[Outcome]) -> str:
    rows = ["| where | command | status | s | CPU s | first line of output | last line of output |",
            "| --- | --- | --- | ---: | ---: | --- | --- |"]
    for o in outcomes:
        if o.ran is None:
            reason = o.command.skip or "the install: the commands run in this environment"
            rows.append(f"| {o.command.where} | `{_cell(o.command.text)}` | skipped | | | {_cell(reason)} | |")
            continue
        lines = [line for line in o.output.splitlines() if line.strip()] or [""]
        status = f"{o.status}" + (f" ({o.problem})" if o.problem else "")
        rows.append(f"| {o.command.where} | `{_cell(o.ran)}` | {_cell(status)} | {o.seconds:.0f} | "
                    f"{o.cpu_seconds:.0f} | {_cell(lines[0])} | {_cell(lines[-1])} |")
    total, cpu = sum(o.seconds for o in outcomes), sum(o.cpu_seconds for o in outcomes)
    failed = sum(bool(o.problem) for o in outcomes)
    return "\n".join(rows) + (f"\n\n{len(outcomes)} commands, {failed} not as documented, {total:.0f} s of commands, "
                               f"{cpu:.0f} CPU s\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the repository to copy (default: this one)")
    parser.add_argument("--report", type=Path, help="write the report here (default: print it)")
    parser.add_argument("--lanes", type=int, default=LANES, help=f"documents running at once (default {LANES})")
    args = parser.parse_args(argv)

    def progress(outcome: Outcome) -> None:
        done = "skipped" if not outcome.ran else (
            f"{outcome.status} in {outcome.seconds:.0f} s ({outcome.cpu_seconds:.0f} CPU s) {outcome.problem}")
        print(f"{outcome.command.where}: {done}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="docs_commands_") as scratch:
        outcomes = run_commands(args.repo.resolve(), Path(scratch), args.lanes, progress)
    print(f"{time.perf_counter() - start:.0f} s in all", file=sys.stderr)
    text = report(outcomes)
    if args.report:
        args.report.write_text(text)
    else:
        print(text)
    return 1 if any(o.problem for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every `python -m MODULE` that README.md, docs/ and train_configs/ name exists and starts (its
--help), and every console script of pyproject.toml points at a main function: a tool that moves
cannot leave its documentation behind."""

import importlib
import importlib.util
import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DOCUMENTS = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "train_configs").rglob("*.toml")]
MODULES = sorted({m for doc in DOCUMENTS for m in re.findall(r"python -m ([\w.]*\w)", doc.read_text())} - {"pytest"})


def test_the_documents_name_the_tools():
    assert {"scripts.preprocess", "scripts.hf", "scripts.sweep", "scripts.memory_estimate", "scripts.autotune"} <= set(
        MODULES
    )


@pytest.mark.parametrize("module", MODULES)
def test_a_documented_module_exists(module):
    assert importlib.util.find_spec(module) is not None, f"{module} is named in the docs but does not exist"


TOOLS = [m for m in MODULES if m.startswith("scripts.")]
HELP = """
import contextlib, io, json, runpy, sys
started = {}
for module in sys.argv[1:]:
    sys.argv, out = [module, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        status, out = 1, io.StringIO(f"{type(e).__name__}: {e}")
    started[module] = (status, out.getvalue())
print(json.dumps(started))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str]]:
    """Each tool's `python -m TOOL --help`, all in one process: one import of torch for them all."""
    result = subprocess.run([sys.executable, "-c", HELP, *TOOLS], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("module", TOOLS)
def test_a_documented_tool_starts(module, helps):
    status, output = helps[module]
    assert status == 0, output[-2000:]
    assert "usage:" in output


@pytest.mark.slow
@pytest.mark.parametrize("module", ["scripts.autotune", "scripts.preflight"])
def test_the_planning_tools_help_gives_every_default_and_an_example(module, helps):
    """Readable without the docs: each option with a value says its default (or that it is required)."""
    options = re.split(r"\n  (?=-)", helps[module][1].split("options:")[1].split("\n\n")[0])[1:]
    valued = [o for o in options if re.match(r"--[\w-]+ [A-Z_]+", o) and not o.startswith("-h")]
    assert valued and all("default" in o or "required" in o for o in valued), [o for o in valued if "default" not in o]
    assert "Example:" in helps[module][1] and f"python -m {module} " in helps[module][1].split("Example:")[1]


def test_console_scripts_point_at_main_functions():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts
    for name, target in scripts.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name

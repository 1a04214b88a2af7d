"""Every `python -m MODULE` that README.md, docs/ and train_configs/ name exists and starts (its
--help), and every console script of pyproject.toml points at a main function: a tool that moves
cannot leave its documentation behind."""

import importlib
import importlib.util
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


@pytest.mark.slow
@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("scripts.")])
def test_a_documented_tool_starts(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_console_scripts_point_at_main_functions():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts
    for name, target in scripts.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name

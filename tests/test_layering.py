"""The layers of the code, as docs/models.md states them: components/ below parallelisms/ below models/ below
scripts/, no import cycles. Read from the source (every import statement, those inside functions included, and
importlib's imports by name: `import_module(f"models.{name}")` imports every family), not by importing."""

import ast
from collections import defaultdict

from conftest import REPO

LAYERS = ("components", "parallelisms", "models", "scripts")
"""Lowest first: a module imports only from its own layer and those before it."""


def imported_by_name(node: ast.Call, modules: dict) -> list[str]:
    """The modules an `importlib.import_module(...)` call can import: its name, or for an f-string, every module
    one level below the f-string's literal start (`f"models.{name}"`: each family package)."""
    name = node.args[0] if node.args else None
    if isinstance(name, ast.Constant) and isinstance(name.value, str):
        return [name.value]
    if isinstance(name, ast.JoinedStr) and name.values and isinstance(name.values[0], ast.Constant):
        start = name.values[0].value
        return [m for m in modules if m.startswith(start) and "." not in m[len(start):]]
    return []


def called_name(call: ast.Call) -> str:
    return getattr(call.func, "attr", getattr(call.func, "id", ""))


def imports() -> dict[str, set[str]]:
    """Module -> the ingot modules it imports (`from a.b import c` counts as a.b, and as a.b.c where that is one)."""
    modules = {}
    for layer in LAYERS:
        for path in (REPO / layer).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    graph = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.Call) and called_name(node) == "import_module":
                targets = imported_by_name(node, modules)
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target] if target in path else [module, target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_no_module_imports_from_a_layer_above_its_own_and_no_imports_go_round_in_a_cycle():
    graph = imports()
    layer = {name: LAYERS.index(name.split(".")[0]) for name in graph} | {
        target: LAYERS.index(target.split(".")[0]) for targets in graph.values() for target in targets}
    upward = sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                    if layer[target] > layer[module])
    assert not upward, upward
    assert not cycles(graph), cycles(graph)
    assert graph["components.config.loading"] and graph["parallelisms.context_parallel"]  # the reading works
    assert {"models.llama3", "models.qwen3"} <= graph["models.families"]  # importlib's imports by name too

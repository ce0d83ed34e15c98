"""rl_engine's import graph, read from the source with `ast` (no module is imported): no import cycle, and no
arrow up. A module may import its own group and the groups of lower layers only (docs/design.md, "Folder tree"):
kernels never import models, rollout, integrations or checks; checks and integrations may import anything below.
Imports inside functions count (a late import is still an arrow), those under `if TYPE_CHECKING:` do not (they
never run), and the `rl-engine` subcommands count as imports of the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "rl_engine"

# Lowest first. A group is the first name under rl_engine (rl_engine.kernels.ops.triton.moe -> "kernels");
# the package itself is a facade whose names load lazily (its runtime code imports no rl_engine module).
LAYERS = (
    ("errors", {"rl_engine", "errors"}),
    ("foundation", {"bits", "environment", "outputs", "loading", "metrics"}),
    ("kernels", {"kernels"}),
    ("models", {"models", "mhc", "losses"}),
    ("parallel", {"parallel", "workload"}),
    ("rollout", {"rollout"}),
    ("user code", {"integrations", "checks"}),
    ("entry points", {"cli", "nn", "flash_attn"}),  # the CLI, and the public paths rl_engine.nn / rl_engine.flash_attn
)
RANK = {group: rank for rank, (_, groups) in enumerate(LAYERS) for group in groups}


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py file of the package under root."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node except the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _subcommand_modules(tree: ast.AST) -> list[str]:
    """The modules of the CLI's SUBCOMMANDS table ({"name": ("module", "help"), ...}): imported by name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SUBCOMMANDS" for t in node.targets):
            return [ast.literal_eval(value)[0] for value in node.value.values]
    return []


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports. `from P import x` is an import of P.x when that is a
    module, else of P; an import of a name that is not one of the package's modules counts for the nearest
    module above it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                targets.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    if name == f"{PACKAGE}.cli":
        targets += _subcommand_modules(tree)
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import of a module of another group on the same or a higher layer."""
    return [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
            if group(a) != group(b) and RANK[group(a)] <= RANK[group(b)]]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_is_in_a_layer(graph):
    assert not sorted({group(m) for m in graph} - set(RANK)), "add the new group to LAYERS (and docs/design.md)"


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_arrow_up(graph):
    assert arrows_up(graph) == []


def test_the_package_itself_imports_nothing_at_run_time(graph):
    assert graph[PACKAGE] == set()  # its names load on first use (__getattr__)


def test_the_graph_sees_late_relative_and_subcommand_imports(graph):
    assert f"{PACKAGE}.checks.operators.check_op" in graph[f"{PACKAGE}.cli"]  # SUBCOMMANDS
    assert f"{PACKAGE}.kernels.ops.triton.attention.gluon_decode" in graph[
        f"{PACKAGE}.kernels.ops.triton.attention.dispatch"]  # imported inside flash_forward


def test_a_planted_cycle_and_arrow_up_are_caught(tmp_path, graph):
    # In the real graph: the attention contract importing the dispatch closes a cycle through the Gluon kernels.
    planted = {k: set(v) for k, v in graph.items()}
    attention = f"{PACKAGE}.kernels.ops.triton.attention"
    planted[f"{attention}.contract"].add(f"{attention}.dispatch")
    cycle = find_cycle(planted)
    assert cycle is not None and f"{attention}.contract" in cycle and f"{attention}.dispatch" in cycle

    # From source: a kernel that imports a model late (and the model the kernel, relatively) is an arrow up and a
    # cycle; a TYPE_CHECKING import is neither.
    files = {
        "__init__.py": "",
        "kernels/__init__.py": "",
        "kernels/moe.py": "def width():\n    from rl_engine.models.moe import router_width\n    return router_width\n",
        "models/__init__.py": "",
        "models/moe.py": "from typing import TYPE_CHECKING\nfrom ..kernels import moe\n"
                         "if TYPE_CHECKING:\n    from rl_engine.checks import harness\n",
        "checks/__init__.py": "",
        "checks/harness.py": "from rl_engine.models import moe\n",
    }
    for rel, text in files.items():
        (tmp_path / PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / rel).write_text(text)
    small = import_graph(tmp_path)
    assert small[f"{PACKAGE}.models.moe"] == {f"{PACKAGE}.kernels.moe"}  # relative; TYPE_CHECKING skipped
    assert arrows_up(small) == [f"{PACKAGE}.kernels.moe -> {PACKAGE}.models.moe"]
    cycle = find_cycle(small)
    assert cycle[0] == cycle[-1] and sorted(cycle[1:]) == [f"{PACKAGE}.kernels.moe", f"{PACKAGE}.models.moe"]
    del small[f"{PACKAGE}.kernels.moe"]  # the late import gone: neither
    assert arrows_up(small) == [] and find_cycle(small) is None

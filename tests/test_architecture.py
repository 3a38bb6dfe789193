"""The layering of the package, read from the source with `ast` (nothing is imported).

Units are the top-level pieces of `rollart_hpc`: its sub-packages (`rollart_hpc.envs`, ...) and its
top-level modules (`rollart_hpc.rl_common`, ...), `rollart_hpc.kernels` among them. Every import counts, wherever it is written: module level, inside a function,
under `if TYPE_CHECKING:`, relative or absolute, and `importlib.import_module("literal")`. A lazy import
is for a heavy dependency, never to hide a cycle, so the graph between units must be acyclic; the ground
units import (almost) nothing: `contracts` nothing of the package, `config` only `contracts`, and
`kernels` nothing outside itself.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "rollart_hpc"
# The layers. Roles are what a rank runs; they stand side by side and talk only through `contracts` (the
# wire payloads of every tag), so no role imports another. Libraries sit below the roles and import none of
# them. The top layer (commands, benchmarks, the simulator) may import anything.
ROLES = ("controller", "envs", "rollout", "reward", "train")
LIBRARIES = (
    "contracts", "config", "kernels", "algo", "tasks", "inference", "routing", "models", "weights", "store",
    "metrics", "cluster", "plan", "api", "sweep",
)  # fmt: skip
TOP = ("entry", "bench", "sim", "chaos")
# The commands: each parses its arguments and calls a library (or top-layer) function. Nothing else in the
# package imports them (`launch.py` and the tests, outside the package, may).
COMMANDS = "entry"
# Units that must stay free of MPI and torch.distributed (pure logic, testable without a world).
NO_DISTRIBUTED = ("algo", "config")
# Folder -> the package name it is installed as.
ROOTS = {REPO / "rollart_hpc": PACKAGE}


@dataclass(frozen=True)
class Edge:
    """One import statement: `source` (a module file) imports `target` (a module name) at `line`."""

    path: Path
    line: int
    source: str
    target: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line} imports {self.target}"


def package_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    modules = {}
    for folder, name in ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([name, *parts])] = path
    return modules


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module named by `from ... import` in `module` (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imported(module: str, path: Path, tree: ast.AST, known: set[str]) -> Iterator[tuple[int, str]]:
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"  # `from pkg import submodule`
                yield node.lineno, sub if sub in known else base
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value


def _is_import_module(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name == "import_module"


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import of a package module by a package module."""
    known = set(modules)
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in dict.fromkeys(_imported(module, path, tree, known)):
            if target == PACKAGE or target.startswith(f"{PACKAGE}."):
                edges.append(Edge(path, line, module, target))
    return edges


def unit(module: str) -> str:
    """`rollart_hpc.tasks.families.household` -> `tasks`; `rollart_hpc.rl_common` -> `rl_common`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph(edges: list[Edge]) -> dict[str, dict[str, list[Edge]]]:
    """unit -> imported unit -> the import statements that make that dependency."""
    graph: dict[str, dict[str, list[Edge]]] = defaultdict(lambda: defaultdict(list))
    for edge in edges:
        a, b = unit(edge.source), unit(edge.target)
        if a != b:
            graph[a][b].append(edge)
    return graph


def _shortest_cycle(graph: dict[str, dict[str, list[Edge]]], start: str) -> list[str] | None:
    """The shortest path start -> ... -> start (breadth first), or None."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


def find_cycles(graph: dict[str, dict[str, list[Edge]]]) -> list[list[str]]:
    """One shortest cycle through each unit that lies on a cycle, without repeats (rotations merged)."""
    cycles, seen = [], set()
    for start in sorted(graph):
        cycle = _shortest_cycle(graph, start)
        if cycle is None:
            continue
        ring = cycle[:-1]
        i = ring.index(min(ring))
        key = tuple(ring[i:] + ring[:i])
        if key not in seen:
            seen.add(key)
            cycles.append([*key, key[0]])
    return sorted(cycles, key=lambda c: (len(c), c))


def describe_cycle(graph: dict[str, dict[str, list[Edge]]], cycle: list[str]) -> str:
    """`import cycle: a -> b -> a` plus, per step, the first import statement that makes it."""
    steps = [f"    {a} -> {b}: {graph[a][b][0]}" for a, b in zip(cycle, cycle[1:], strict=False)]
    return "import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(steps)


def _graph() -> dict[str, dict[str, list[Edge]]]:
    return unit_graph(import_edges(package_modules()))


def _outside(graph: dict[str, dict[str, list[Edge]]], name: str, allowed: set[str]) -> list[str]:
    return [str(e) for b, es in sorted(graph.get(name, {}).items()) if b not in allowed for e in es]


def layer_violations(graph: dict[str, dict[str, list[Edge]]]) -> list[str]:
    """Imports that break the layers: a role importing another role, a library importing a role or the top."""
    bad = []
    for a, targets in sorted(graph.items()):
        for b, edges in sorted(targets.items()):
            if a in ROLES and b in ROLES:
                bad.append(f"role {a} imports role {b}: {edges[0]}")
            elif a in LIBRARIES and b in (*ROLES, *TOP):
                bad.append(
                    f"library {a} imports {'role' if b in ROLES else 'top-layer unit'} {b}: {edges[0]}"
                )
    return bad


def command_importers(graph: dict[str, dict[str, list[Edge]]]) -> list[str]:
    """Imports of the command unit from any other unit (a bench or library reaching into a command)."""
    return [
        f"{a} imports the commands: {es[0]}"
        for a, t in sorted(graph.items())
        for b, es in t.items()
        if b == COMMANDS
    ]


def external_imports(unit_name: str, prefixes: tuple[str, ...]) -> list[str]:
    """`path:line imports X` for every import in `unit_name` of a module named by one of `prefixes`."""
    found = []
    modules = package_modules()
    for module, path in modules.items():
        if unit(module) != unit_name:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in _imported(module, path, tree, set(modules)):
            if any(target == p or target.startswith(p + ".") for p in prefixes):
                found.append(f"{path.relative_to(REPO)}:{line} imports {target}")
            elif target == "torch" and _imports_distributed_from_torch(tree, line):
                found.append(f"{path.relative_to(REPO)}:{line} imports torch.distributed")
    return found


def _imports_distributed_from_torch(tree: ast.AST, line: int) -> bool:
    """`from torch import distributed` at `line`."""
    return any(
        isinstance(node, ast.ImportFrom)
        and node.lineno == line
        and node.module == "torch"
        and any(alias.name == "distributed" for alias in node.names)
        for node in ast.walk(tree)
    )


# ---- the checks of the reader itself --------------------------------------------------------------------
def test_reader_resolves_relative_function_level_and_dynamic_imports():
    source = (
        "from . import sibling\n"
        "from ..config import schema\n"
        "def f():\n"
        "    from .sibling import thing\n"
        "    import rollart_hpc.contracts.errors\n"
        "    importlib.import_module('rollart_hpc.store')\n"
    )
    known = {"rollart_hpc.envs.sibling", "rollart_hpc.config.schema"}
    found = [t for _, t in _imported("rollart_hpc.envs.main", Path("main.py"), ast.parse(source), known)]
    assert found == [
        "rollart_hpc.envs.sibling",
        "rollart_hpc.config.schema",
        "rollart_hpc.envs.sibling",
        "rollart_hpc.contracts.errors",
        "rollart_hpc.store",
    ]
    in_init = ast.parse("from .types import Env\n")
    assert [t for _, t in _imported("rollart_hpc.envs", Path("__init__.py"), in_init, set())] == [
        "rollart_hpc.envs.types"
    ]


def test_reader_finds_cycles_and_names_them():
    edges = [
        Edge(REPO / "a.py", 1, "rollart_hpc.controller.core", "rollart_hpc.envs.types"),
        Edge(REPO / "b.py", 2, "rollart_hpc.envs.main", "rollart_hpc.controller.core"),
        Edge(REPO / "c.py", 3, "rollart_hpc.envs.main", "rollart_hpc.config"),
    ]
    graph = unit_graph(edges)
    assert find_cycles(graph) == [["controller", "envs", "controller"]]
    assert describe_cycle(graph, ["controller", "envs", "controller"]).startswith(
        "import cycle: controller -> envs -> controller\n    controller -> envs: a.py:1 imports"
    )


def test_layer_check_names_a_role_importing_a_role():
    edges = [
        Edge(REPO / "a.py", 7, "rollart_hpc.envs.main", "rollart_hpc.rollout.main"),
        Edge(REPO / "b.py", 3, "rollart_hpc.tasks.build", "rollart_hpc.controller.core"),
        Edge(REPO / "c.py", 5, "rollart_hpc.envs.main", "rollart_hpc.tasks.build"),
        Edge(REPO / "d.py", 9, "rollart_hpc.entry.cli", "rollart_hpc.train.main"),
    ]
    assert layer_violations(unit_graph(edges)) == [
        "role envs imports role rollout: a.py:7 imports rollart_hpc.rollout.main",
        "library tasks imports role controller: b.py:3 imports rollart_hpc.controller.core",
    ]


def test_command_check_names_a_unit_importing_a_command():
    edges = [
        Edge(REPO / "a.py", 4, "rollart_hpc.bench.e2e", "rollart_hpc.entry.sweep"),
        Edge(REPO / "b.py", 2, "rollart_hpc.entry.sweep", "rollart_hpc.sweep.grid"),
        Edge(REPO / "c.py", 8, "rollart_hpc.entry.cli", "rollart_hpc.entry.sweep"),
    ]
    assert command_importers(unit_graph(edges)) == [
        "bench imports the commands: a.py:4 imports rollart_hpc.entry.sweep"
    ]


def test_every_package_is_installed():
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {m for m, path in package_modules().items() if path.name == "__init__.py"}
    assert found == listed, (
        f"pyproject's [tool.setuptools] packages differ: add {found - listed}, drop {listed - found}"
    )


def test_kernels_live_inside_the_package():
    # A top-level `kernels/` folder would shadow the `kernels` distribution that transformers imports
    # whenever the repository root is on sys.path (pytest, `python launch.py`).
    modules = package_modules()
    assert modules["rollart_hpc.kernels.policy_loss"] == REPO / "rollart_hpc" / "kernels" / "policy_loss.py"
    assert not (REPO / "kernels").exists()
    assert modules["rollart_hpc.config"] == REPO / "rollart_hpc" / "config" / "__init__.py"


# ---- the architecture ----------------------------------------------------------------------------------
def test_no_import_cycle_between_units():
    graph = _graph()
    cycles = find_cycles(graph)
    assert not cycles, "\n".join(describe_cycle(graph, c) for c in cycles)


def test_every_unit_has_a_declared_layer():
    units = {unit(m) for m in package_modules()} - {PACKAGE}
    undeclared = sorted(units - {*ROLES, *LIBRARIES, *TOP})
    assert not undeclared, f"declare each unit as a role, a library or the top layer: {undeclared}"


def test_roles_are_peers_and_libraries_import_no_role():
    bad = layer_violations(_graph())
    assert not bad, "the layers are roles side by side over libraries:\n" + "\n".join(bad)


def test_nothing_outside_the_commands_imports_them():
    bad = command_importers(_graph())
    assert not bad, "only launch.py and the tests import rollart_hpc.entry:\n" + "\n".join(bad)


def test_rollout_and_train_never_import_each_other():
    graph = _graph()
    bad = [
        str(e) for a, b in (("rollout", "train"), ("train", "rollout")) for e in graph.get(a, {}).get(b, [])
    ]
    assert not bad, "\n".join(bad)


def test_algo_and_config_use_no_mpi_or_torch_distributed():
    bad = [hit for name in NO_DISTRIBUTED for hit in external_imports(name, ("mpi4py", "torch.distributed"))]
    assert not bad, "algo and config stay free of MPI and torch.distributed:\n" + "\n".join(bad)


def test_contracts_import_no_other_unit():
    bad = _outside(_graph(), "contracts", set())
    assert not bad, "contracts is the ground layer and imports nothing of the package:\n" + "\n".join(bad)


def test_config_imports_only_contracts():
    bad = _outside(_graph(), "config", {"contracts"})
    assert not bad, "config may import only contracts:\n" + "\n".join(bad)


def test_kernels_import_nothing_of_the_package_outside_kernels():
    bad = _outside(_graph(), "kernels", set())
    assert not bad, "rollart_hpc.kernels stands alone:\n" + "\n".join(bad)


def test_no_two_public_classes_of_the_package_share_a_name():
    where: dict[str, list[str]] = defaultdict(list)
    for module, path in package_modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(module)
    shared = {name: mods for name, mods in where.items() if len(mods) > 1}
    assert not shared, f"class names defined more than once: {shared}"

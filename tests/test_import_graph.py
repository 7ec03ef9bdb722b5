"""The lab's import graph, read from the source with `ast` (nothing is imported): no cycle, no import up a floor.

Floors, lowest first: `reference` and `kernels` (0), `engine` (1), `ablations` (2: the ladder), and on 3 what may read
the ladder (its environment, workloads, plans, probes, timing, records): the measurement tools, `bench` (the server from
outside) and `measure` (the engine and kernels), and `paper`. Tests and notebooks sit above all and are not walked. A
module may import any package on its own floor or a lower one (`kernels` reads `reference`'s constants); an import of a
higher floor is refused. Every import counts, whether at the top of a module or inside a function: a deferred import is
still a dependency. A cycle is a strongly connected set of more than one module in the graph of module -> lab module it
imports (a `from package import name` names the submodule `package.name` where that file exists, else the package's
`__init__`). The registry builds the backbone, so the backbone (and what it imports) never reaches the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"reference": 0, "kernels": 0, "engine": 1, "ablations": 2, "bench": 3, "measure": 3, "paper": 3}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def lab_modules(root: Path) -> dict[str, Path]:
    """Every module of the walked packages: dotted name -> file."""
    return {module_name(p, root): p for package in FLOORS for p in sorted((root / package).rglob("*.py"))}


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The lab modules one file imports (absolute and relative imports, at any depth of the file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import engine.stages.x` -> the deepest lab module named
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    found.discard(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = lab_modules(root)
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a package on a higher floor."""
    bad = []
    for name, targets in sorted(graph.items()):
        own = name.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if FLOORS[other] > FLOORS[own]:
                bad.append(f"{name} -> {target} (floor {FLOORS[own]} imports floor {FLOORS[other]})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    found = cycles(import_graph(ROOT))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_up_a_floor():
    found = floor_violations(import_graph(ROOT))
    assert found == [], "imports up a floor: " + "; ".join(found)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_backbone_never_reaches_the_registry():
    graph = import_graph(ROOT)
    assert "engine.backbone" in reachable(graph, "engine.stages")
    assert not {m for m in reachable(graph, "engine.backbone") if m.startswith("engine.stages")}


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def tiny_lab(tmp_path: Path) -> Path:
    write(
        tmp_path,
        {
            "reference/__init__.py": "",
            "reference/ops.py": "import numpy\n",
            "kernels/__init__.py": "from kernels import norms\n",
            "kernels/norms.py": "from reference import ops\n",
            "engine/__init__.py": "",
            "engine/plan.py": "from . import tree\n",
            "engine/tree.py": "def f():\n    from engine.plan import x\n",
            "engine/backbone.py": "import engine.tree\nfrom kernels.norms import y\n",
            "ablations/__init__.py": "",
            "ablations/run.py": "from engine import backbone\n",
            "paper/__init__.py": "",
            "paper/build.py": "from ablations.run import z\n",
        },
    )
    return tmp_path


def test_the_walk_sees_relative_deferred_and_package_imports(tiny_lab):
    graph = import_graph(tiny_lab)
    assert graph["engine.plan"] == {"engine.tree"}  # relative
    assert graph["engine.tree"] == {"engine.plan"}  # inside a function
    assert graph["engine.backbone"] == {"engine.tree", "kernels.norms"}
    assert graph["kernels"] == {"kernels.norms"}  # `from package import submodule`
    assert graph["reference.ops"] == set()  # outside the lab
    assert cycles(graph) == [["engine.plan", "engine.tree"]]
    assert floor_violations(graph) == []  # kernels -> reference: the same floor


def test_the_walk_catches_an_import_up_a_floor(tiny_lab):
    write(tiny_lab, {"engine/plan.py": "", "engine/tree.py": "import ablations.run\n"})
    graph = import_graph(tiny_lab)
    assert cycles(graph) == [["ablations.run", "engine.backbone", "engine.tree"]]
    assert floor_violations(graph) == ["engine.tree -> ablations.run (floor 1 imports floor 2)"]

"""No import cycles between the project's modules (lazy and TYPE_CHECKING imports included).

A cycle makes import order matter and hides which package depends on which; the package map of
docs/architecture.md is only true without them. The graph is read from the source with ``ast``
(nothing is imported), so a cycle through an import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "swarm", "node", "coordinator", "trainer", "policy")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _targets(node: ast.AST, here: str, is_pkg: bool, modules: dict[str, Path]) -> set[str]:
    """Project modules that one import statement loads (the most specific existing module)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = here.split(".") if is_pkg else here.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        # ``from pkg import sub`` loads the submodule; ``from pkg import name`` loads ``pkg``
        names = [f"{base}.{alias.name}" for alias in node.names]
    out: set[str] = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_pkg = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(node, name, is_pkg, modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_detector_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "policy.draw" in graph["node.backends.hf"]  # module level
    assert "coordinator.datasets" in graph["coordinator.tasks"]  # inside make_task()


def test_no_import_cycles_between_project_modules() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


#: package -> role packages it must not import (docs/architecture.md, "must not")
FORBIDDEN = {
    "policy": {"node", "coordinator", "trainer", "swarm"},
    "protocol": {"node", "coordinator", "trainer", "swarm", "policy"},
    "coordinator": {"node", "trainer"},
    "trainer": {"node", "coordinator"},
    "node": {"coordinator", "trainer"},
}


def test_roles_share_the_sampling_contract_not_each_others_internals() -> None:
    bad = [
        f"{mod} imports {dep}"
        for mod, deps in import_graph().items()
        for dep in deps
        if dep.split(".")[0] in FORBIDDEN.get(mod.split(".")[0], set())
    ]
    assert not bad, "; ".join(sorted(bad))

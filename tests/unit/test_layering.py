"""The layers import downwards only: protocol <- swarm's peer layer <- the roles <- the shell.

``protocol`` (wire types) imports no other project package; the peer layer (``swarm`` outside
``swarm.shell``: DHT, transport, broadcast, status server) knows no role; the roles
(``coordinator``, ``node``, ``trainer``, and ``policy``, the sampling contract they share) never
reach up into the user-facing shell (``swarm.shell``: the CLI, demo, inspect, config reference)
that drives them. The graph is read with ``ast`` (top-level, function-level and TYPE_CHECKING
imports alike; nothing is imported), by ``tests/unit/test_import_cycles.py``.
"""

from __future__ import annotations

from tests.unit.test_import_cycles import import_graph

ROLES = ("coordinator", "node", "trainer", "policy")
SHELL = "swarm.shell"


def _top(module: str) -> str:
    return module.split(".")[0]


def _in_shell(module: str) -> bool:
    return module == SHELL or module.startswith(SHELL + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    """``"a imports b (rule)"`` for every edge of ``graph`` (module -> imported modules) that runs
    against the layering, sorted."""
    bad: list[str] = []
    for mod, deps in graph.items():
        for dep in deps:
            if _top(mod) == "protocol" and _top(dep) in ("swarm", *ROLES):
                bad.append(f"{mod} imports {dep} (protocol imports no other project package)")
            elif _top(mod) == "swarm" and not _in_shell(mod) and _top(dep) in ROLES:
                bad.append(f"{mod} imports {dep} (the peer layer knows no role)")
            elif _top(mod) in ROLES and _in_shell(dep):
                bad.append(f"{mod} imports {dep} (a role never imports the shell)")
    return sorted(bad)


def test_the_checker_finds_each_kind_of_upward_import() -> None:
    graph = {
        "protocol.messages": {"swarm.keys"},
        "swarm.dht": {"protocol.messages", "coordinator.tasks"},
        "swarm.shell.cli": {"coordinator.launch", "trainer.main", "swarm.dht"},
        "swarm.shell": set(),
        "trainer.main": {"swarm.shell.heldout", "swarm.dht", "policy.model"},
        "node.statuspage": {"swarm.shell"},
        "policy.model": {"protocol.messages"},
    }
    assert violations(graph) == [
        "node.statuspage imports swarm.shell (a role never imports the shell)",
        "protocol.messages imports swarm.keys (protocol imports no other project package)",
        "swarm.dht imports coordinator.tasks (the peer layer knows no role)",
        "trainer.main imports swarm.shell.heldout (a role never imports the shell)",
    ]
    # a module whose name merely starts like the shell's is not in it
    assert violations({"swarm.shellfish": {"node.main"}}) == [
        "swarm.shellfish imports node.main (the peer layer knows no role)"
    ]


def test_the_graph_holds_the_shell_and_its_function_level_imports() -> None:
    graph = import_graph()
    assert "swarm.shell.cli" in graph, "the shell lives in swarm/shell/"
    assert "trainer.main" in graph["swarm.shell.cli"]  # inside `swarm trainer run`


def test_every_import_runs_down_the_layers() -> None:
    bad = violations(import_graph())
    assert not bad, "; ".join(bad)

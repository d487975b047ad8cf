"""The collectors' place in msmon's layers (issue 32): no import cycle runs through a collector,
and no collector imports what sits above the collectors (the api, the launcher, the hooks'
instrumentors), function-level imports included, TYPE_CHECKING blocks not."""

from __future__ import annotations

import ast
from pathlib import Path

import msmon

PACKAGE = Path(msmon.__file__).parent
ABOVE_COLLECTORS = (
    "msmon.monitor",
    "msmon.api",
    "msmon.launcher",
    "msmon.hooks.attach",
    "msmon.hooks.explicit",
    "msmon.hooks.torch_optim",
    "msmon.hooks.deepspeed",
    "msmon.hooks.megatron",
    "msmon.hooks.fsdp",
    "msmon.hooks.torch_distributed",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("msmon",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def _import_graph() -> dict[str, set[str]]:
    """Every msmon module and the msmon modules it imports: `from a import b` counts as module
    `a.b` where that is a module, else as `a`."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

    def module_of(name: str) -> str:
        while name not in paths and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        skipped = {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in ast.walk(node)
        }
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found |= {module_of(a.name) for a in node.names if a.name.split(".")[0] == "msmon"}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if target.split(".")[0] == "msmon":
                    found |= {module_of(f"{target}.{a.name}") for a in node.names}
        graph[name] = found - {name}
    return graph


def test_no_import_cycle_runs_through_a_collector():
    graph = _import_graph()
    collectors = sorted(m for m in graph if m.startswith("msmon.collectors."))
    cycles = []
    for start in collectors:
        # a path from the collector back to itself, found by a depth-first walk
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    cycles.append(" -> ".join(path + [start]))
                    stack.clear()
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    assert cycles == []


def test_collectors_import_nothing_above_them():
    """The msmon package itself counts as above (it is the api's facade). The comm collector
    listens to the collectives through the listener API in the hooks' core
    (hooks/core/collective_listeners.py), never through the torch_distributed instrumentor."""
    graph = _import_graph()
    upward = {
        name.removeprefix("msmon.collectors."): sorted(
            m for m in imports if m == "msmon" or m.startswith(ABOVE_COLLECTORS)
        )
        for name, imports in graph.items()
        if name.startswith("msmon.collectors")
    }
    assert {name: modules for name, modules in upward.items() if modules} == {}

"""The collectors' place in msmon's layers (issue 32): no import cycle runs through a collector,
and no collector imports what sits above the collectors (the api, the launcher, the hooks'
instrumentors), function-level imports and TYPE_CHECKING blocks included."""

from __future__ import annotations

from import_walk import PACKAGE, module_name, module_of, msmon_imports

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


def _import_graph() -> dict[str, set[str]]:
    """Every msmon module and the msmon modules it imports: `from a import b` counts as module
    `a.b` where that is a module, else as `a`."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {
        name: {module_of(imported, paths) for imported in msmon_imports(path)} - {name} for name, path in paths.items()
    }


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
    (seams/collective_listeners.py), never through the torch_distributed instrumentor."""
    graph = _import_graph()
    upward = {
        name.removeprefix("msmon.collectors."): sorted(
            m for m in imports if m == "msmon" or m.startswith(ABOVE_COLLECTORS)
        )
        for name, imports in graph.items()
        if name.startswith("msmon.collectors")
    }
    assert {name: modules for name, modules in upward.items() if modules} == {}

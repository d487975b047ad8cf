"""The statistics' layer (issue 32): stats/ imports only itself, the config and system/ (never
the runtime, the output or the collectors above it), has no import cycle, and its op table
imports no torch (the config and the offline tools read it)."""

from __future__ import annotations

import subprocess
import sys

from import_walk import PACKAGE
from import_walk import msmon_imports as _msmon_imports

ALLOWED = ("msmon.stats", "msmon.config", "msmon.system")


def _stats_modules() -> dict[str, set[str]]:
    """Each module of stats/ (subpackages included) and the msmon modules it imports."""
    graph = {}
    for path in sorted((PACKAGE / "stats").rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = "msmon." + ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        graph[name] = _msmon_imports(path)
    return graph


def test_stats_imports_only_itself_the_config_and_system():
    outside = {
        name: sorted(m for m in imports if not m.startswith(ALLOWED)) for name, imports in _stats_modules().items()
    }
    assert {name: modules for name, modules in outside.items() if modules} == {}


def test_the_modules_of_stats_import_each_other_without_a_cycle():
    graph = _stats_modules()

    def target(imported: str) -> str | None:
        """The stats module an import names (`from . import native` names msmon.stats.native)."""
        while imported and imported not in graph:
            imported = imported.rpartition(".")[0]
        return imported or None

    edges = {name: {t for m in imports if (t := target(m)) and t != name} for name, imports in graph.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, " -> ".join([*path, name])
        if name in done:
            return
        for child in sorted(edges[name]):
            visit(child, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_importing_the_op_table_imports_no_torch():
    from msmon.stats.ops import OPS

    code = "import sys; from msmon.stats.ops import OPS; print(len(OPS), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(len(OPS)), "False"]

"""The two bottom layers of msmon (issue 32): system/ imports nothing else of msmon, config/ only
system/ and the op table, and importing the config never imports torch (`msmon run`, `msmon
analyse` and the bootstrap read configs in processes that must not load it)."""

from __future__ import annotations

import ast
import subprocess
import sys

from import_walk import PACKAGE
from import_walk import msmon_imports as _msmon_imports


def _layer_imports(folder: str) -> dict[str, set[str]]:
    return {path.name: _msmon_imports(path) for path in sorted((PACKAGE / folder).glob("*.py"))}


def test_system_imports_nothing_else_of_msmon_not_even_for_type_checking():
    outside = {
        name: sorted(m for m in imports if not m.startswith("msmon.system"))
        for name, imports in _layer_imports("system").items()
    }
    assert {name: modules for name, modules in outside.items() if modules} == {}


def test_config_imports_only_itself_system_and_the_op_table():
    allowed = ("msmon.config", "msmon.system", "msmon.stats.ops")
    outside = {
        name: sorted(m for m in imports if not m.startswith(allowed))
        for name, imports in _layer_imports("config").items()
    }
    assert {name: modules for name, modules in outside.items() if modules} == {}


def test_importing_the_config_and_reading_a_config_file_imports_no_torch(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text("wg_distribution: true\nappend_output: []\nops: [norm, nans]\n")
    code = (
        "import sys; from msmon.config import load_config; "
        f"cfg = load_config({str(path)!r}); print(cfg.ops, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['norm', 'nans'] False"


def test_runtime_imports_no_collector_no_hook_instrumentor_and_not_the_api():
    """runtime/ sits below the collectors and the hooks' instrumentors (above seams/: the
    spec, the registry, the adapters): what it needs of them (the collectors built, their target
    checks, the framework packages) is handed down by the api."""
    above = ("msmon.api", "msmon.collectors", "msmon.hooks", "msmon.launcher")
    upward = {
        name: sorted(m for m in imports if m.startswith(above)) for name, imports in _layer_imports("runtime").items()
    }
    assert {name: modules for name, modules in upward.items() if modules} == {}


def test_nothing_in_runtime_names_trainermon_even_as_a_type():
    """Nothing below the api receives TrainerMon: the runtime gets the StepContext or the values
    it needs, so not even a TYPE_CHECKING import of the api is left."""
    for path in sorted((PACKAGE / "runtime").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        assert not {n for n in names if n == "api" or n.endswith(".api") or n.endswith("monitor")}, path.name
        annotations = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.arg) and node.annotation]
        assert not [a for a in annotations if "TrainerMon" in a], path.name

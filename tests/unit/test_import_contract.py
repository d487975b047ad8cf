"""The import contract that `make lint` checks: every module of msmon sits in a layer of
.importlinter, and tools/import_cycles.py finds the cycles import-linter's layers cannot see
(one inside a layer, one that only a function-level import closes)."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "msmon"
CYCLES = ROOT / "tools" / "import_cycles.py"
FRAMEWORK_PACKAGES = ROOT / "tools" / "framework_packages.py"
# the one package whose __init__ is outside every layer: msmon's own (the facade: `msmon.TrainerMon`)
CONTAINERS = {"msmon"}


def _layer_entries() -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    layers = config["importlinter:contract:layers"]["layers"]
    return [name for line in layers.strip().splitlines() for name in re.split(r"[|:]", line) if name.strip()]


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def test_every_msmon_module_sits_in_a_layer_of_the_import_contract():
    entries = [e.strip() for e in _layer_entries()]
    unplaced = [
        m for m in _modules() if m not in CONTAINERS and not any(m == e or m.startswith(e + ".") for e in entries)
    ]
    assert unplaced == [], f"add these modules to a layer in .importlinter: {unplaced}"


def _write_package(root, name: str, files: dict[str, str]) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module, text in files.items():
        (package / f"{module}.py").write_text(textwrap.dedent(text))


def _check(root, name: str, tool: Path = CYCLES) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(tool), name],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_the_cycle_check_finds_a_cycle_closed_by_a_function_level_import_and_names_its_path(tmp_path):
    _write_package(
        tmp_path,
        "cyclic",
        {
            "a": "from . import b\n",
            "b": "def late():\n    from . import c\n",
            "c": "from .a import __name__ as _\n",
        },
    )
    result = _check(tmp_path, "cyclic")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "import cycle among 3 modules: cyclic.a -> cyclic.b -> cyclic.c -> cyclic.a" in result.stdout


def test_the_cycle_check_finds_a_cycle_that_only_a_type_checking_import_closes(tmp_path):
    _write_package(
        tmp_path,
        "typed",
        {
            "a": "from . import b\n",
            "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
        },
    )
    result = _check(tmp_path, "typed")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "import cycle among 2 modules: typed.a -> typed.b -> typed.a" in result.stdout


def test_the_layer_contract_refuses_an_upward_import_made_only_for_type_checking(tmp_path):
    """lint-imports with .importlinter's own settings, over a two-layer package whose lower
    layer names the higher one's type under `if TYPE_CHECKING:`: the contract is broken."""
    _write_package(
        tmp_path,
        "stacked",
        {
            "high": "from . import low\n",
            "low": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import __name__ as _\n",
        },
    )
    ours = configparser.ConfigParser()
    ours.read(ROOT / ".importlinter")
    settings = dict(ours["importlinter"], root_package="stacked", include_external_packages="False")
    config = configparser.ConfigParser()
    config["importlinter"] = settings
    layers = "\nstacked.high\nstacked.low"
    config["importlinter:contract:layers"] = {"name": "stacked", "type": "layers", "layers": layers}
    with open(tmp_path / "contract.ini", "w") as file:
        config.write(file)
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint_imports), "--config", str(tmp_path / "contract.ini"), "--no-cache"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "stacked.low -> stacked.high" in result.stdout


def test_the_framework_check_finds_a_framework_package_that_imports_a_sibling_even_for_types(tmp_path):
    """tools/framework_packages.py: every sub-package of the hooks folder is a framework; one
    may import what they share beside them (handover), never another framework package."""
    hooks = tmp_path / "host" / "hooks"
    for package, text in {
        "host": "",
        "host/hooks": "",
        "host/hooks/alpha": "from .. import handover\n",
        "host/hooks/beta": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..alpha import parts\n",
    }.items():
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").write_text(text)
    (hooks / "handover.py").write_text("")
    (hooks / "alpha" / "parts.py").write_text("")
    result = _check(tmp_path, "host.hooks", FRAMEWORK_PACKAGES)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "framework package imports a sibling: host.hooks.beta -> host.hooks.alpha.parts"
    ]
    (hooks / "beta" / "__init__.py").write_text("from .. import handover\n")
    result = _check(tmp_path, "host.hooks", FRAMEWORK_PACKAGES)
    assert result.returncode == 0, result.stdout + result.stderr

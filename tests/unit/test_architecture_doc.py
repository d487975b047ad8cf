"""docs/architecture.md held to the code where a check can reach it: every file and folder it
names exists, its list of layers is .importlinter's, and its framework table is the registry's."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from conftest import ROOT
from msmon.seams import registry

DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "msmon"
# a source file or folder the page names: `runtime/step.py`, `seams/`, tests/unit/..., `spec.py`
# (not the files a run writes, summary.json; nor templates, `<verb>_command.py`)
NAMED = re.compile(r"(?<![\w./<>*-])((?:[\w-]+/)*[\w-]+(?:\.py|\.md|\.cpp|/))(?![\w/<>-])")
OUTSIDE = {"DESIGN.md"}  # the project's shared design map, outside the repository


def _prose() -> str:
    """The page without its diff examples (files a contributor would add)."""
    return re.sub(r"```diff\n.*?```", "", DOC.read_text(encoding="utf-8"), flags=re.S)


def _exists(name: str, folders: list[Path]) -> bool:
    if "/" not in name.rstrip("/"):  # a bare file or folder name: somewhere in the source or the repo's tools
        return any(folder.joinpath(name.rstrip("/")).exists() for folder in folders)
    return any((folder / name).exists() for folder in folders)


def test_every_file_and_folder_the_architecture_page_names_exists():
    folders = [ROOT, PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    folders += [ROOT / "tests", ROOT / "tests" / "unit", ROOT / "benchmarks", ROOT / "tools"]
    named = sorted({m.group(1) for m in NAMED.finditer(_prose())})
    assert len(named) > 100  # the reader reads them all
    missing = [name for name in named if name not in OUTSIDE and not _exists(name, folders)]
    assert missing == []


def _module(name: str) -> str:
    """`runtime/` -> msmon.runtime, `auto.py` -> msmon.auto."""
    return "msmon." + name.strip().removesuffix("/").removesuffix(".py")


def _doc_layers() -> list[list[set[str]]]:
    """The page's layer list: per line, its independent parts (│), each a set of modules (·)."""
    block = _prose().split("## The layers", 1)[1].split("```", 2)[1]
    layers = []
    for line in block.strip().splitlines():
        first_column = re.split(r"\s{3,}", line.strip())[0]
        parts = [part.strip() for part in first_column.split("│")]
        layers.append([{_module(name) for name in part.split("·")} for part in parts])
    return layers


def test_the_pages_layers_are_the_import_contracts_in_their_order():
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    contract = []
    for line in config["importlinter:contract:layers"]["layers"].strip().splitlines():
        contract.append([{name.strip() for name in part.split(":")} for part in line.split("|")])
    assert _doc_layers() == contract


def test_the_pages_framework_table_is_the_registrys():
    table = _prose().split("### One package per framework", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `hooks/([\w]+)/` \| `([\w.]+)` \|", table, flags=re.M)
    assert sorted(rows) == sorted((spec.name, spec.switched_on_by) for spec in registry.frameworks())

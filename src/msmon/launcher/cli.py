"""`msmon`: monitor an unmodified training job (`run`), print its module tree (`struct`),
order the anomalies it raised (`analyse`), convert its output (`convert csv2tb | tb2csv`); after
the run, one database of every rank (`db`) and a report to look at (`report`).

Each verb is one file, `launcher/<verb>_command.py`, defining its click command; this module
only finds those files and assembles their commands into the `msmon` group, so a new verb is
that one file (its name also goes in `.importlinter`'s torch-free list, which a test checks)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import click

VERB_FILE_SUFFIX = "_command"


def verb_commands(folder: Path = Path(__file__).parent, package: str = __package__ or "") -> list[click.Command]:
    """The click commands the `<verb>_command.py` files of `folder` (the package `package`)
    define, in file-name order: each file's own commands that are not a subcommand of its own
    group (`convert`'s `csv2tb` belongs to `convert`)."""
    commands: list[click.Command] = []
    for module in sorted(pkgutil.iter_modules([str(folder)]), key=lambda m: m.name):
        if module.ispkg or not module.name.endswith(VERB_FILE_SUFFIX):
            continue
        loaded = importlib.import_module(f"{package}.{module.name}")
        own = [
            value
            for value in vars(loaded).values()
            if isinstance(value, click.Command) and getattr(value.callback, "__module__", None) == loaded.__name__
        ]
        inside = [sub for group in own if isinstance(group, click.Group) for sub in group.commands.values()]
        commands.extend(command for command in own if not any(command is sub for sub in inside))
    return commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="msmon")
def main() -> None:
    """Training-state monitor for PyTorch (msprobe monitor compatible)."""


for _command in verb_commands():
    main.add_command(_command)

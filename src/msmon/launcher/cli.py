"""`msmon`: monitor an unmodified training job (`run`), print its module tree (`struct`),
order the anomalies it raised (`analyse`), convert its output (`convert csv2tb | tb2csv`); after
the run, one database of every rank (`db`) and a report to look at (`report`).

Each verb is one file, `launcher/<verb>_command.py`, defining its click command; this module
only finds those files and assembles their commands into the `msmon` group, so a new verb is
that one file (`.importlinter` holds every module directly in launcher/ to never importing torch,
so the new file is checked without a line there)."""

from __future__ import annotations

import importlib
import pkgutil
import re
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


def first_sentence(help_text: str) -> str:
    """A command's summary for `msmon --help`: the first sentence of its help, whole. Click
    would cut it to the room left on one line ("Order the anomalies of every rank in time and
    print the..."); given as short_help, it is wrapped instead."""
    paragraph = re.sub(r"\s+", " ", help_text.strip().split("\n\n")[0])
    match = re.match(r"(.+?\.)(?:\s|$)", paragraph)
    return match.group(1) if match else paragraph


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="msmon")
def main() -> None:
    """Training-state monitor for PyTorch (msprobe monitor compatible)."""


def whole_summaries(group: click.Group) -> None:
    """Every command of `group` (and of its subgroups: `convert`'s) listed with its first sentence whole."""
    for command in group.commands.values():
        if not command.short_help and command.help:
            command.short_help = first_sentence(command.help)
        if isinstance(command, click.Group):
            whole_summaries(command)


for _command in verb_commands():
    main.add_command(_command)
whole_summaries(main)

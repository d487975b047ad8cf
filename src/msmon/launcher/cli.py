"""`msmon`: monitor an unmodified training job (`run`), print its module tree (`struct`),
order the anomalies it raised (`analyse`), convert its output (`convert csv2tb | tb2csv`); after
the run, one database of every rank (`db`) and a report to look at (`report`). Each verb lives
in its own `<verb>_command.py`; this module only assembles them into the `msmon` group."""

from __future__ import annotations

import click

from .analyse_command import analyse
from .build_native_command import build_native
from .convert_command import convert
from .db_command import db
from .report_command import report
from .run_command import run
from .struct_command import struct


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="msmon")
def main() -> None:
    """Training-state monitor for PyTorch (msprobe monitor compatible)."""


main.add_command(run)
main.add_command(struct)
main.add_command(analyse)
main.add_command(build_native)
main.add_command(convert)
main.add_command(db)
main.add_command(report)

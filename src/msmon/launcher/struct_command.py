"""`msmon struct`: run a job until its first optimizer step and print its module structure."""

from __future__ import annotations

import sys
from typing import Any

import click

from .launch import JOB_SETTINGS, JobClickCommand, job_from_context, launch

STRUCT_CONFIG: dict[str, Any] = {"print_struct": True, "format": ["csv"]}


@click.command("struct", cls=JobClickCommand, context_settings=JOB_SETTINGS)
@click.option("--output-dir", type=click.Path(file_okay=False), help="Where the structure is written.")
@click.option(
    "--no-torchrun",
    is_flag=True,
    help="Run the command as it is, not under torchrun: a script in one python process, or a launcher.",
)
@click.pass_context
def struct(ctx: click.Context, output_dir: str | None, no_torchrun: bool) -> None:
    """Run a training job until its first optimizer step, print and write its module
    structure (the names `targets` accepts, with shapes and dtypes), and stop.

    \b
    msmon struct [torchrun options] -- train.py [args]
    """
    command = job_from_context(ctx, no_torchrun)
    sys.exit(launch(command, dict(STRUCT_CONFIG), None, output_dir, "struct"))

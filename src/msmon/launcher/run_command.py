"""`msmon run`: monitor an unmodified training job, started by torchrun, by any launcher program
(accelerate, deepspeed, python with mp.spawn or Lightning, srun's tasks) or as one plain python."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..config import ConfigError, load_config, read_config_file
from ..output.sinks import check_formats
from .bootstrap import job_directory
from .launch import JOB_SETTINGS, JobClickCommand, job_from_context, launch


@click.command("run", cls=JobClickCommand, context_settings=JOB_SETTINGS)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Monitor config (JSON or YAML). Without it a built-in default is used and printed.",
)
@click.option("--output-dir", type=click.Path(file_okay=False), help="Where the ranks write (sets MONITOR_OUTPUT_DIR).")
@click.option(
    "--no-torchrun",
    is_flag=True,
    help="Run the command as it is, not under torchrun: a script in one python process, or a launcher.",
)
@click.pass_context
def run(ctx: click.Context, config_path: str | None, output_dir: str | None, no_torchrun: bool) -> None:
    """Monitor an unmodified training job.

    \b
    msmon run --config monitor.json [torchrun options] -- train.py [args]
    msmon run --config monitor.json --nproc-per-node 8 -- -m package.module [args]
    msmon run --config monitor.json -- accelerate launch --num_processes 8 train.py [args]

    Every torchrun option (--nproc-per-node, --nnodes, --node-rank, --rdzv-backend,
    --rdzv-endpoint, --master-addr, --master-port, --standalone, ...) passes through
    unchanged. A program after `--` (accelerate, deepspeed, python, a shell script) is its own
    launcher: it runs as it is, and every training rank it starts is monitored. The exit code
    is the job's.
    """
    command = job_from_context(ctx, no_torchrun)
    if config_path:
        config = _load(config_path)
    else:
        config = read_config_file(job_directory.DEFAULT_CONFIG)
        click.echo(
            "msmon: no --config given; using the built-in default config:\n" + json.dumps(config, indent=2), err=True
        )
    sys.exit(launch(command, config, config_path, output_dir, "run"))


def _load(config_path: str) -> dict[str, Any]:
    try:
        config = load_config(config_path)
        check_formats(config, config_path)  # reads the sink files' names: no torch
        for line in config.translation:  # an msprobe V2 config: what each of its keys became
            click.echo(f"msmon: {line}", err=True)
        return config.raw
    except ConfigError as exc:
        raise click.ClickException(f"invalid config: {exc}")

"""`msmon`: monitor an unmodified training job (`run`), print its module tree (`struct`),
order the anomalies it raised (`analyse`), convert its output (`convert csv2tb | tb2csv`); after
the run, one database of every rank (`db`) and a report to look at (`report`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import click

from ..config import ConfigError, load_config, read_config_file
from ..output import ensure_writable, output_base_dir
from . import bootstrap, report
from .command import JobCommand, UsageError, parse, sitecustomize_disabled_by
from .convert_command import convert
from .db_command import db as db_command
from .report_command import report as report_command

ENV_KEEP_BOOTSTRAP = "MSMON_KEEP_BOOTSTRAP"
STRUCT_CONFIG = {"print_struct": True, "format": ["csv"]}


class _JobCommand(click.Command):
    """Everything after the first `--` is the training command; msmon's own options come
    before it, and every other option there is torchrun's, passed through in order."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta["msmon.target"] = args[cut + 1 :]
            args = args[:cut]
        else:
            ctx.meta["msmon.target"] = None
        return super().parse_args(ctx, args)


_JOB_SETTINGS = {"ignore_unknown_options": True, "allow_extra_args": True, "allow_interspersed_args": True}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="msmon")
def main() -> None:
    """Training-state monitor for PyTorch (msprobe monitor compatible)."""


@main.command(cls=_JobCommand, context_settings=_JOB_SETTINGS)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Monitor config (JSON or YAML). Without it a built-in default is used and printed.",
)
@click.option("--output-dir", type=click.Path(file_okay=False), help="Where the ranks write (sets MONITOR_OUTPUT_DIR).")
@click.option("--no-torchrun", is_flag=True, help="Run one plain python process instead of torchrun.")
@click.pass_context
def run(ctx: click.Context, config_path: str | None, output_dir: str | None, no_torchrun: bool) -> None:
    """Monitor an unmodified training job.

    \b
    msmon run --config monitor.json [torchrun options] -- train.py [args]
    msmon run --config monitor.json --nproc-per-node 8 -- -m package.module [args]

    Every torchrun option (--nproc-per-node, --nnodes, --node-rank, --rdzv-backend,
    --rdzv-endpoint, --master-addr, --master-port, --standalone, ...) passes through
    unchanged. The exit code is the job's.
    """
    command = _job(ctx, no_torchrun)
    if config_path:
        config = _load(config_path)
    else:
        config = read_config_file(bootstrap.DEFAULT_CONFIG)
        click.echo(
            "msmon: no --config given; using the built-in default config:\n" + json.dumps(config, indent=2), err=True
        )
    sys.exit(_launch(command, config, config_path, output_dir, not no_torchrun, "run"))


@main.command(cls=_JobCommand, context_settings=_JOB_SETTINGS)
@click.option("--output-dir", type=click.Path(file_okay=False), help="Where the structure is written.")
@click.option("--no-torchrun", is_flag=True, help="Run one plain python process instead of torchrun.")
@click.pass_context
def struct(ctx: click.Context, output_dir: str | None, no_torchrun: bool) -> None:
    """Run a training job until its first optimizer step, print and write its module
    structure (the names `targets` accepts, with shapes and dtypes), and stop.

    \b
    msmon struct [torchrun options] -- train.py [args]
    """
    command = _job(ctx, no_torchrun)
    sys.exit(_launch(command, dict(STRUCT_CONFIG), None, output_dir, not no_torchrun, "struct"))


class _SeveralSteps(click.Command):
    """`-s 3 4 5`: one option followed by several steps, as msprobe writes it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        expanded: list[str] = []
        pending = False  # an -s whose first value has not come yet
        in_steps = False
        for arg in args:
            if arg in ("-s", "--steps"):
                pending = in_steps = True
            elif in_steps and _is_int(arg):
                expanded += ["-s", arg]
                pending = False
            else:
                if pending:
                    expanded.append("-s")  # click then reports the bad or missing value
                pending = in_steps = False
                expanded.append(arg)
        if pending:
            expanded.append("-s")
        return super().parse_args(ctx, expanded)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


@main.command(cls=_SeveralSteps)
@click.option(
    "-d",
    "--dir",
    "directory",
    required=True,
    type=click.Path(file_okay=False),
    help="The anomaly_detected directory of a run.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="A directory, or the .json file for msmon's report (default: DIR/msmon_analyse.json); "
    "msprobe's anomaly_analyse.json is written beside it.",
)
@click.option(
    "-k",
    "--top-k",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="How many of the first anomalies to print.",
)
@click.option("-s", "--steps", type=int, multiple=True, help="Only these steps: -s 3 4 5.")
def analyse(directory: str, output: str | None, top_k: int, steps: tuple[int, ...]) -> None:
    """Order the anomalies of every rank in time and print the first ones."""
    try:
        from ..anomaly.analyse import run_analyse
    except ImportError as exc:
        raise click.ClickException(f"the anomaly analyser is not available in this installation: {exc}")
    sys.exit(run_analyse(directory, output, top_k, list(steps) or None))


@main.command("build-native")
def build_native() -> None:
    """Build the one-pass CPU statistics kernel now (a C++ compiler, a few seconds).

    Monitors build it themselves on first use; this does it ahead of time, e.g. on a login node
    whose cache ($MSMON_CACHE_DIR, else ~/.cache/msmon) the compute nodes share.
    MSMON_NATIVE_STATS=0 turns it off."""
    from .. import native

    os.environ[native.ENV] = "1"
    if native.load() is None:
        raise click.ClickException(
            "the native statistics could not be built (see the error above); monitors keep using torch reductions"
        )
    how = f"built in {native.build_seconds:.1f} s" if native.compiled_here else "already built"
    click.echo(f"msmon: native statistics {how} ({native.isa()} loop on this CPU): {native.built_path()}")


main.add_command(convert)


main.add_command(db_command)
main.add_command(report_command)


# -- helpers -------------------------------------------------------------------------------------
def _job(ctx: click.Context, no_torchrun: bool) -> JobCommand:
    try:
        return parse(list(ctx.args), ctx.meta.get("msmon.target"), use_torchrun=not no_torchrun)
    except UsageError as exc:
        raise click.UsageError(str(exc), ctx)


def _load(config_path: str) -> dict[str, Any]:
    try:
        return load_config(config_path).raw
    except ConfigError as exc:
        raise click.ClickException(f"invalid config: {exc}")


def _launch(
    command: JobCommand,
    config: dict[str, Any],
    config_source: str | None,
    output_dir: str | None,
    use_torchrun: bool,
    mode: str,
) -> int:
    base = os.path.abspath(output_dir) if output_dir else output_base_dir()
    try:
        ensure_writable(base)
        if config.get("append_output"):  # a range that selects no earlier directory: say so before torchrun
            from ..resume import check_range

            check_range(base, config["append_output"])
    except ConfigError as exc:
        raise click.ClickException(str(exc))
    flag = sitecustomize_disabled_by(command)
    if flag:
        click.echo(
            f"msmon: warning: `{os.path.basename(command.target[0])} {flag}` skips sitecustomize, so msmon "
            "cannot load by itself in this job; add `import msmon.auto` at the top of the training script "
            "(see docs/launcher.md)",
            err=True,
        )
    directory = bootstrap.create(config, config_source, "torchrun" if use_torchrun else "python", mode, output_dir)
    try:
        env = bootstrap.job_environment(os.environ, directory, output_dir)
        lock = bootstrap.lock_fd(directory)
        code = _run_child(command.argv(use_torchrun), env, () if lock is None else (lock,))
        for line in report.summary_lines(report.worker_records(directory), mode):
            click.echo(line, err=True)
    finally:
        if os.environ.get(ENV_KEEP_BOOTSTRAP):
            bootstrap.keep(directory)
            click.echo(f"msmon: bootstrap directory kept: {directory}", err=True)
        else:
            bootstrap.remove(directory)
    return code


def _run_child(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> int:
    """Run the job and return its exit code. Ctrl-C reaches the job from the terminal (the
    launcher outlives it to print the summary); SIGTERM and SIGHUP are passed on. `pass_fds`:
    the bootstrap directory's lock, held by the job's first process too."""
    proc = subprocess.Popen(argv, env=env, pass_fds=pass_fds)
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *forwarded)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in forwarded:
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code

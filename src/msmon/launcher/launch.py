"""Launching a training job under msmon, shared by `run` and `struct`: the `--` split of the
command line, the bootstrap directory around the job, the child process and its signals, and
the end-of-job summary."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import click

from ..config import ConfigError
from ..output.directory import ensure_writable, output_base_dir
from ..records.runs import new_run_id
from ..system.decision import choose, read_decisions
from . import run_summary
from .bootstrap import job_directory
from .job_command_line import JobCommand, UsageError, parse, sitecustomize_disabled_by
from .signal_forwarding import SignalForwarding

ENV_KEEP_BOOTSTRAP = "MSMON_KEEP_BOOTSTRAP"
STRUCT_SCRATCH = "struct_output"  # `msmon struct`: where its ranks write, inside the bootstrap directory
STRUCT_DIR = "module_struct"  # what `msmon struct` keeps: <output>/module_struct/rank<r>/module_struct.json


class JobClickCommand(click.Command):
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


JOB_SETTINGS: dict[str, Any] = {
    "ignore_unknown_options": True,
    "allow_extra_args": True,
    "allow_interspersed_args": True,
}


def job_from_context(ctx: click.Context, no_torchrun: bool) -> JobCommand:
    """The checked job command line of a `JobClickCommand` call; a mistake is click's usage error."""
    try:
        return parse(list(ctx.args), ctx.meta.get("msmon.target"), use_torchrun=not no_torchrun)
    except UsageError as exc:
        raise click.UsageError(str(exc), ctx)


def launch(
    command: JobCommand,
    config: dict[str, Any],
    config_source: str | None,
    output_dir: str | None,
    mode: str,
) -> int:
    """Run the job with `config` in a fresh bootstrap directory; returns the job's exit code."""
    base = os.path.abspath(output_dir) if output_dir else output_base_dir()
    try:
        ensure_writable(base)
        if config.get("append_output"):  # a range that selects no earlier directory: say so before torchrun
            from ..output.resume import check_range

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
    run_id = new_run_id() if mode == "run" else None
    scratch = None
    if mode == "struct":  # its rank directories would read as a run of their own: they stay in the scratch
        scratch = job_directory.scratch_dir(STRUCT_SCRATCH)
        output_dir = scratch
    directory = job_directory.create(config, config_source, command.launcher, mode, output_dir, run_id)
    try:
        env = job_directory.job_environment(os.environ, directory, output_dir, run_id)
        lock = job_directory.lock_fd(directory)
        code = run_child(command.argv(), env, () if lock is None else (lock,))
        if scratch is not None:
            keep_structure(scratch, base)
        decision = choose(read_decisions(directory))
        if decision is not None:  # a stop msmon decided: its code, not the launcher's (torchrun's 1)
            code = decision.code
        lines = run_summary.summary_lines(
            run_summary.worker_records(directory), mode, base, run_id, config_source=config_source, decision=decision
        )
        for line in lines:
            click.echo(line, err=True)
    finally:
        if os.environ.get(ENV_KEEP_BOOTSTRAP):
            job_directory.keep(directory)
            click.echo(f"msmon: bootstrap directory kept: {directory}", err=True)
        else:
            job_directory.remove(directory)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return code


def keep_structure(scratch: str, base: str) -> None:
    """Move what `msmon struct`'s ranks wrote that is worth keeping, the module trees, from the
    scratch to `base`/module_struct/rank<r>/ (an earlier tree of the same rank is replaced); the
    rest (rank directories, config, summary) goes with the scratch, so no later reader of `base`
    takes it for a run."""
    source = os.path.join(scratch, STRUCT_DIR)
    if not os.path.isdir(source):
        return
    target = os.path.join(base, STRUCT_DIR)
    os.makedirs(target, exist_ok=True)
    for name in sorted(os.listdir(source)):
        destination = os.path.join(target, name)
        shutil.rmtree(destination, ignore_errors=True)
        shutil.move(os.path.join(source, name), destination)


def run_child(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> int:
    """Run the job and return its exit code. SIGTERM and SIGHUP are passed on to it, and SIGINT
    unless the job got it from the terminal too (signal_forwarding.py); the launcher outlives
    the job to print the summary. `pass_fds`: the bootstrap directory's lock, held by the job's
    first process too."""
    proc = subprocess.Popen(argv, env=env, pass_fds=pass_fds)
    with SignalForwarding(proc):
        code = proc.wait()
    return 128 - code if code < 0 else code

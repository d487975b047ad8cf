"""The job's command line: torchrun's options, passed through untouched, and the training
target, checked before anything starts. The target is a Python script (`train.py args`), a
module (`-m package.module args`) or a program that starts the job itself (`accelerate launch
...`, `deepspeed ...`, `python train.py`, a shell script): a program is run as it is, never
through torchrun, since it is its own launcher."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

# torchrun itself, through msmon's entry point: the same main, quiet where the ranks stopped on
# msmon's config error (bootstrap/torchrun.py)
TORCHRUN = [sys.executable, "-m", "msmon.launcher.bootstrap.torchrun"]
# python flags that skip sitecustomize: -E and -I ignore PYTHONPATH, -S skips site entirely
_NO_SITECUSTOMIZE_FLAGS = set("EIS")
SCRIPT, MODULE, PROGRAM = "script", "module", "program"


class UsageError(ValueError):
    """A mistake in the command line, reported before the job starts."""


@dataclass
class JobCommand:
    torchrun_args: list[str]
    target: list[str]  # ["train.py", *args], ["-m", "package.module", *args] or ["accelerate", *args]
    kind: str = SCRIPT
    use_torchrun: bool = True  # False: --no-torchrun, or a program that launches the job itself

    @property
    def is_module(self) -> bool:
        return self.kind == MODULE

    @property
    def no_python(self) -> bool:
        """torchrun's --no-python: the target is an executable, not a Python script."""
        return any(a in ("--no-python", "--no_python") for a in self.torchrun_args)

    @property
    def launcher(self) -> str:
        """What the job's first process is (the bootstrap's role detection reads it):
        "torchrun", "python" (the script itself) or "program"."""
        if self.use_torchrun:
            return "torchrun"
        return "program" if self.kind == PROGRAM else "python"

    def argv(self) -> list[str]:
        target = ["-m", *self.target[1:]] if self.is_module else list(self.target)
        if self.use_torchrun:
            return [*TORCHRUN, *self.torchrun_args, *target]
        return target if self.kind == PROGRAM else [sys.executable, *target]


def parse(torchrun_args: list[str], target: list[str] | None, use_torchrun: bool) -> JobCommand:
    """Check the split command line; raise UsageError with what to write instead."""
    if not target:
        raise UsageError(
            "missing the training script: write `-- train.py [args]`, `-- -m package.module [args]` or "
            "`-- <launcher command>` after msmon's and torchrun's options"
        )
    if not use_torchrun and torchrun_args:
        raise UsageError(f"torchrun options {' '.join(torchrun_args)} cannot be used with --no-torchrun")
    command = JobCommand(list(torchrun_args), list(target), use_torchrun=use_torchrun)
    if target[0] in ("-m", "--module"):
        if len(target) < 2 or target[1].startswith("-"):
            raise UsageError("-m needs a module name: `-- -m package.module [args]`")
        command.kind = MODULE
        return command
    if command.no_python:
        command.kind = PROGRAM  # torchrun starts it on every rank
        return command
    command.kind = target_kind(target[0])
    if command.kind == PROGRAM:
        if torchrun_args:
            raise UsageError(
                f"{target[0]!r} is a program, not a Python script: msmon runs it as it is, without torchrun, so "
                f"the torchrun options {' '.join(torchrun_args)} do not apply (give them to the program, or add "
                "--no-python to have torchrun start it on every rank)"
            )
        command.use_torchrun = False
    return command


def target_kind(first: str) -> str:
    """SCRIPT for a Python file (`.py`, or a file that is not executable), PROGRAM for an
    executable or a command on PATH; UsageError for neither."""
    if os.path.isfile(first):
        if first.endswith(".py") or not os.access(first, os.X_OK):
            return SCRIPT
        return PROGRAM
    if os.sep not in first and shutil.which(first):
        return PROGRAM
    raise UsageError(
        f"training script {first!r} not found (working directory {os.getcwd()}), nor a program of that name on PATH"
    )


def sitecustomize_disabled_by(command: JobCommand) -> str | None:
    """The python flag in the training command that keeps msmon from loading, if any. Only a
    program target (run as it is, or by torchrun's --no-python) names the interpreter and its flags."""
    if command.kind != PROGRAM or not os.path.basename(command.target[0]).startswith("python"):
        return None
    args = command.target[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg.startswith("--") or arg == "-":
            return None  # the script, stdin, or a long option: python's own flags are over
        for position, letter in enumerate(arg[1:], start=2):
            if letter in _NO_SITECUSTOMIZE_FLAGS:
                return f"-{letter}"
            if letter in "cm":  # the rest is the program
                return None
            if letter in "WX":  # takes a value: the rest of this argument, or the next one
                i += position == len(arg)
                break
        i += 1
    return None

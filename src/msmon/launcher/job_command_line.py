"""The job's command line: torchrun's options, passed through untouched, and the training
target (`script.py args` or `-m package.module args`), checked before anything starts."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# python flags that skip sitecustomize: -E and -I ignore PYTHONPATH, -S skips site entirely
_NO_SITECUSTOMIZE_FLAGS = set("EIS")


class UsageError(ValueError):
    """A mistake in the command line, reported before the job starts."""


@dataclass
class JobCommand:
    torchrun_args: list[str]
    target: list[str]  # ["train.py", *args] or ["-m", "package.module", *args]

    @property
    def is_module(self) -> bool:
        return self.target[0] in ("-m", "--module")

    @property
    def no_python(self) -> bool:
        """torchrun's --no-python: the target is an executable, not a Python script."""
        return any(a in ("--no-python", "--no_python") for a in self.torchrun_args)

    def argv(self, use_torchrun: bool) -> list[str]:
        if not use_torchrun:
            return [sys.executable, *self.target]
        if self.is_module:
            return [*TORCHRUN, *self.torchrun_args, "-m", *self.target[1:]]
        return [*TORCHRUN, *self.torchrun_args, *self.target]


def parse(torchrun_args: list[str], target: list[str] | None, use_torchrun: bool) -> JobCommand:
    """Check the split command line; raise UsageError with what to write instead."""
    if not target:
        raise UsageError(
            "missing the training script: write `-- train.py [args]` or `-- -m package.module [args]` "
            "after msmon's and torchrun's options"
        )
    if not use_torchrun and torchrun_args:
        raise UsageError(f"torchrun options {' '.join(torchrun_args)} cannot be used with --no-torchrun")
    command = JobCommand(list(torchrun_args), list(target))
    if command.is_module:
        if len(target) < 2 or target[1].startswith("-"):
            raise UsageError("-m needs a module name: `-- -m package.module [args]`")
    elif not command.no_python and not os.path.isfile(target[0]):
        raise UsageError(f"training script {target[0]!r} not found (working directory {os.getcwd()})")
    return command


def sitecustomize_disabled_by(command: JobCommand) -> str | None:
    """The python flag in the training command that keeps msmon from loading, if any. Only
    torchrun's --no-python lets the command name the interpreter and its flags."""
    if not command.no_python or not os.path.basename(command.target[0]).startswith("python"):
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

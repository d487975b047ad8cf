"""Process start-up in a job launched by `msmon run`: is this a training worker, and if so,
arrange for msmon to attach once torch is imported.

Standard library only (wrapt is imported in workers alone): `msmon run` copies this file
into the job's bootstrap directory, where its sitecustomize imports it before anything else,
so it must not import msmon's package (which imports torch) or torch itself. What starts the
worker once torch is imported (worker.py's `start`) is handed in by the sitecustomize, so this
module imports nothing of msmon, even when torch comes.

Roles, decided from the environment alone:
  worker  a process that may be a training rank: every python process of the job but those
          below. It arms a post-import hook on torch; whether it really is a rank is decided
          when it builds an optimizer or a framework hands msmon one (hooks.Session.may_attach):
          launcher processes (accelerate's, deepspeed's, the mp.spawn parent) build none, and
          DataLoader workers are refused there. A rank marks itself in MSMON_ACTIVE_PID then,
          or at start-up when its launcher said so in the environment (`rank_by_environment`);
  agent   torchrun's own agent process, when `msmon run` started torchrun: nothing happens;
  child   any process started by a marked rank (DataLoader workers, torch.compile workers,
          multiprocessing helpers): the rank's mark is inherited; nothing happens;
  active  this very process was already activated (idempotent start-up).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from types import ModuleType

ENV_ACTIVE_PID = "MSMON_ACTIVE_PID"
ENV_BOOTSTRAP_DIR = "MSMON_BOOTSTRAP_DIR"  # = msmon.system.environment.ENV_BOOTSTRAP_DIR (no msmon import here)
SETTINGS_FILE = "bootstrap.json"
WORKERS_DIR = "workers"  # one record per activated worker: <host>-<pid>.json
TORCHRUN_WORKER_ENV = "TORCHELASTIC_RUN_ID"
ENV_LAUNCHER_PID = "MSMON_LAUNCHER_PID"  # `msmon run`'s pid: the job's first process is its child

WORKER, AGENT, CHILD, ACTIVE = "worker", "agent", "child", "active"

_booted = False


def decide_role(environ: Mapping[str, str], pid: int, launcher: str | None) -> str:
    """The role of process `pid` with environment `environ`; `launcher` is "torchrun",
    "python" or None (no launcher: `import msmon.auto` in a script run by hand)."""
    mark = environ.get(ENV_ACTIVE_PID, "")
    if mark == str(pid):
        return ACTIVE
    if mark:
        return CHILD
    if launcher == "torchrun" and not environ.get(TORCHRUN_WORKER_ENV):
        return AGENT
    return WORKER


def mark_active(environ: MutableMapping[str, str], pid: int) -> None:
    """Mark `pid` as a training rank; every process it starts from now on inherits the mark."""
    environ[ENV_ACTIVE_PID] = str(pid)


def rank_by_environment(environ: Mapping[str, str]) -> bool:
    """A torch elastic agent (torchrun, accelerate launch) started this process as a rank. Not
    RANK: a user's shell or batch script may export it around a launcher whose children are
    the ranks (`bootstrap` removes a parent job's TORCHELASTIC_RUN_ID)."""
    return bool(environ.get(TORCHRUN_WORKER_ENV))


def is_first_process(environ: Mapping[str, str]) -> bool:
    """This process is the one `msmon run` started (the script, or the launcher program)."""
    return environ.get(ENV_LAUNCHER_PID) == str(os.getppid())


def read_settings(bootstrap_dir: str) -> dict:
    with open(os.path.join(bootstrap_dir, SETTINGS_FILE), encoding="utf-8") as fh:
        return json.load(fh)


def is_child_here() -> bool:
    """True in a process started by a marked rank: a forked child inherits the rank's memory
    (its armed hooks too) and environment, hence another pid in the mark."""
    mark = os.environ.get(ENV_ACTIVE_PID)
    return bool(mark) and mark != str(os.getpid())


def main(bootstrap_dir: str, start: Callable[[str], object]) -> None:
    """Start-up of one process; never raises (a failure is reported and monitoring stays off).
    In a worker, `start(bootstrap_dir)` runs once the script imports torch."""
    global _booted
    if _booted:
        return
    _booted = True
    try:
        settings = read_settings(bootstrap_dir)
        role = decide_role(os.environ, os.getpid(), settings.get("launcher"))
        if role != WORKER:
            return
        if rank_by_environment(os.environ):
            mark_active(os.environ, os.getpid())  # else marked when it builds an optimizer
        msmon_path = settings.get("msmon_path")
        if msmon_path and msmon_path not in sys.path:
            import importlib.util

            if importlib.util.find_spec("msmon") is None:
                sys.path.append(msmon_path)
        import wrapt

        wrapt.register_post_import_hook(_on_torch_imported(bootstrap_dir, start), "torch")
    except Exception as exc:  # start-up must never stop the user's program
        sys.stderr.write(f"msmon: start-up failed in pid {os.getpid()}; this process is not monitored: {exc!r}\n")


def _on_torch_imported(bootstrap_dir: str, start: Callable[[str], object]) -> Callable[[ModuleType], None]:
    def hook(_torch_module: ModuleType) -> None:
        if is_child_here():
            return
        try:
            start(bootstrap_dir)
        except Exception as exc:
            sys.stderr.write(f"msmon: could not start monitoring in pid {os.getpid()}: {exc!r}\n")

    return hook

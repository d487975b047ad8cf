"""Process start-up in a job launched by `msmon run`: is this a training worker, and if so,
arrange for msmon to attach once torch is imported.

Standard library only (wrapt is imported in workers alone): `msmon run` copies this file
into the job's bootstrap directory, where its sitecustomize imports it before anything else,
so it must not import msmon's package (which imports torch) or torch itself.

Roles, decided from the environment alone:
  worker  a training process: torchrun's worker (it has TORCHELASTIC_RUN_ID) or, without
          torchrun, the one python process the launcher started;
  agent   torchrun's own agent process, which starts the workers;
  child   any process started by an active worker (DataLoader workers, torch.compile
          workers, multiprocessing helpers): the worker marks itself in MSMON_ACTIVE_PID
          and its children inherit the mark;
  active  this very process was already activated (idempotent start-up).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from types import ModuleType

ENV_ACTIVE_PID = "MSMON_ACTIVE_PID"
ENV_BOOTSTRAP_DIR = "MSMON_BOOTSTRAP_DIR"  # = msmon.environment.ENV_BOOTSTRAP_DIR (this file imports nothing of msmon)
SETTINGS_FILE = "bootstrap.json"
WORKERS_DIR = "workers"  # one record per activated worker: <host>-<pid>.json
TORCHRUN_WORKER_ENV = "TORCHELASTIC_RUN_ID"

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
    """Mark `pid` as the active worker; every process it starts inherits the mark."""
    environ[ENV_ACTIVE_PID] = str(pid)


def read_settings(bootstrap_dir: str) -> dict:
    with open(os.path.join(bootstrap_dir, SETTINGS_FILE), encoding="utf-8") as fh:
        return json.load(fh)


def is_active_here() -> bool:
    """True in the process that was activated, false in its forked children (they inherit
    the parent's memory and environment, hence the parent's pid in the mark)."""
    return os.environ.get(ENV_ACTIVE_PID) == str(os.getpid())


def main(bootstrap_dir: str) -> None:
    """Start-up of one process; never raises (a failure is reported and monitoring stays off)."""
    global _booted
    if _booted:
        return
    _booted = True
    try:
        settings = read_settings(bootstrap_dir)
        role = decide_role(os.environ, os.getpid(), settings.get("launcher"))
        if role != WORKER:
            return
        mark_active(os.environ, os.getpid())
        msmon_path = settings.get("msmon_path")
        if msmon_path and msmon_path not in sys.path:
            import importlib.util

            if importlib.util.find_spec("msmon") is None:
                sys.path.append(msmon_path)
        import wrapt

        wrapt.register_post_import_hook(_on_torch_imported(bootstrap_dir), "torch")
    except Exception as exc:  # start-up must never stop the user's program
        sys.stderr.write(f"msmon: start-up failed in pid {os.getpid()}; this process is not monitored: {exc!r}\n")


def _on_torch_imported(bootstrap_dir: str) -> Callable[[ModuleType], None]:
    def hook(_torch_module: ModuleType) -> None:
        if not is_active_here():
            return
        try:
            from msmon.launcher.worker import start

            start(bootstrap_dir)
        except Exception as exc:
            sys.stderr.write(f"msmon: could not start monitoring in pid {os.getpid()}: {exc!r}\n")

    return hook

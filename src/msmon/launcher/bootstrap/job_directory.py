"""The per-job bootstrap directory and the environment that makes every process of the job
load it.

The directory holds `sitecustomize.py` and `_msmon_boot.py` (copied from this package),
`config.json` (the resolved config), `bootstrap.json` (how the job was launched) and, as the
job runs, `workers/<host>-<pid>.json` (one per monitored worker). It is put first on
PYTHONPATH: launchers that filter environment variables still carry PYTHONPATH, and the
config travels inside it.

The launcher removes it at the end; a launcher killed with SIGKILL cannot. So the launcher
holds an flock on `job.lock` inside it, passed on to the job's first process (torchrun, python
with --no-torchrun, or the launcher program), and every `msmon run` removes, as it starts, the `msmon-job-*`
directories of the temp directory whose lock nobody holds any more: no process of their job
is left. A directory without a lock file (being created this very moment, kept with
MSMON_KEEP_BOOTSTRAP, or written by an older msmon) is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Mapping
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, nothing is taken for stale
    fcntl = None  # type: ignore[assignment]

from ...output.directory import ENV_OUTPUT_DIR
from ...records.runs import ENV_RUN_ID
from . import boot

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_FILE = "config.json"
DEFAULT_CONFIG = os.path.join(HERE, "default_config.json")
# variables a parent job may have left that would mislead this job's role detection
_STALE = (boot.ENV_ACTIVE_PID, boot.TORCHRUN_WORKER_ENV)
PREFIX = "msmon-job-"
LOCK_FILE = "job.lock"
STALE_AFTER_S = 5.0  # a lock file younger than this may not be locked yet
_held: dict[str, int] = {}  # bootstrap directory -> the descriptor holding its lock


def create(
    config: Mapping[str, Any],
    config_source: str | None,
    launcher: str,
    mode: str,
    output_dir: str | None,
    run_id: str | None = None,
) -> str:
    """Write a fresh bootstrap directory and return its path.

    launcher: "torchrun", "python" or "program" (job_command_line.JobCommand.launcher);
    mode: "run" or "struct"; config_source: the user's config file (workers read it when they
    can, so edits during the run take effect)."""
    remove_stale()
    directory = tempfile.mkdtemp(prefix=PREFIX)
    _lock(directory)
    shutil.copyfile(os.path.join(HERE, "sitecustomize.py"), os.path.join(directory, "sitecustomize.py"))
    shutil.copyfile(os.path.join(HERE, "boot.py"), os.path.join(directory, "_msmon_boot.py"))
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as fh:
        json.dump(dict(config), fh, indent=2)
    settings = {
        "launcher": launcher,
        "mode": mode,
        "config": CONFIG_FILE,
        "config_source": os.path.abspath(config_source) if config_source else None,
        "output_dir": os.path.abspath(output_dir) if output_dir else None,
        "run_id": run_id,
        "msmon_path": os.path.dirname(os.path.dirname(os.path.dirname(HERE))),
    }
    with open(os.path.join(directory, boot.SETTINGS_FILE), "w", encoding="utf-8") as fh:
        json.dump(settings, fh, indent=2)
    return directory


def scratch_dir(what: str) -> str:
    """A fresh temporary directory of a job (`msmon struct`'s output) that the launcher removes."""
    return tempfile.mkdtemp(prefix=f"msmon-{what}-")


def job_environment(
    base: Mapping[str, str], bootstrap_dir: str, output_dir: str | None, run_id: str | None = None
) -> dict[str, str]:
    """`base` with the bootstrap first on PYTHONPATH, the output directory and the run id set
    (a run id inherited from an enclosing job is dropped: this job is a run of its own)."""
    env = {k: v for k, v in base.items() if k not in _STALE and k != ENV_RUN_ID}
    if run_id:
        env[ENV_RUN_ID] = run_id
    python_path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = bootstrap_dir + (os.pathsep + python_path if python_path else "")
    env[boot.ENV_BOOTSTRAP_DIR] = bootstrap_dir
    env[boot.ENV_LAUNCHER_PID] = str(os.getpid())
    if output_dir:
        env[ENV_OUTPUT_DIR] = os.path.abspath(output_dir)
    return env


def lock_fd(bootstrap_dir: str) -> int | None:
    """The descriptor holding the directory's lock: the job's first process inherits it, so
    the directory is not stale while that process lives, even if the launcher is killed."""
    return _held.get(bootstrap_dir)


def remove(bootstrap_dir: str) -> None:
    shutil.rmtree(bootstrap_dir, ignore_errors=True)
    _release(bootstrap_dir)


def keep(bootstrap_dir: str) -> None:
    """Leave the directory for inspection (MSMON_KEEP_BOOTSTRAP): without its lock file it is
    never taken for stale."""
    try:
        os.remove(os.path.join(bootstrap_dir, LOCK_FILE))
    except OSError:
        pass
    _release(bootstrap_dir)


def remove_stale(temp_dir: str | None = None) -> list[str]:
    """Remove this user's `msmon-job-*` directories in `temp_dir` (default: the temp
    directory, $TMPDIR) whose job has no process left; return them."""
    if fcntl is None:
        return []
    base = temp_dir or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    for entry in entries:
        if entry.name.startswith(PREFIX) and entry.path not in _held and _remove_if_stale(entry):
            removed.append(entry.path)
    return removed


def _remove_if_stale(entry: os.DirEntry) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        fd = os.open(os.path.join(entry.path, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # gone, someone else's, or no lock file: never ours to judge
    try:
        if time.time() - max(info.st_mtime, os.fstat(fd).st_mtime) < STALE_AFTER_S:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: a process of that job is alive
        shutil.rmtree(entry.path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _lock(directory: str) -> None:
    if fcntl is None:
        return
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held[directory] = fd


def _release(directory: str) -> None:
    fd = _held.pop(directory, None)
    if fd is not None:
        os.close(fd)

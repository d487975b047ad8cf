"""The per-job bootstrap directory and the environment that makes every process of the job
load it.

The directory holds `sitecustomize.py` and `_msmon_boot.py` (copied from this package),
`config.json` (the resolved config), `bootstrap.json` (how the job was launched) and, as the
job runs, `workers/<host>-<pid>.json` (one per monitored worker). It is put first on
PYTHONPATH: launchers that filter environment variables still carry PYTHONPATH, and the
config travels inside it.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Mapping

from ..output import ENV_OUTPUT_DIR
from . import boot

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_FILE = "config.json"
DEFAULT_CONFIG = os.path.join(HERE, "default_config.json")
# variables a parent job may have left that would mislead this job's role detection
_STALE = (boot.ENV_ACTIVE_PID, boot.TORCHRUN_WORKER_ENV)


def create(config: Mapping[str, Any], config_source: str | None, launcher: str, mode: str,
           output_dir: str | None) -> str:
    """Write a fresh bootstrap directory and return its path.

    launcher: "torchrun" or "python"; mode: "run" or "struct"; config_source: the user's
    config file (workers read it when they can, so edits during the run take effect)."""
    directory = tempfile.mkdtemp(prefix="msmon-job-")
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
        "msmon_path": os.path.dirname(os.path.dirname(HERE)),
    }
    with open(os.path.join(directory, boot.SETTINGS_FILE), "w", encoding="utf-8") as fh:
        json.dump(settings, fh, indent=2)
    return directory


def job_environment(base: Mapping[str, str], bootstrap_dir: str, output_dir: str | None) -> dict[str, str]:
    """`base` with the bootstrap first on PYTHONPATH and the output directory set."""
    env = {k: v for k, v in base.items() if k not in _STALE}
    python_path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = bootstrap_dir + (os.pathsep + python_path if python_path else "")
    env[boot.ENV_BOOTSTRAP_DIR] = bootstrap_dir
    if output_dir:
        env[ENV_OUTPUT_DIR] = os.path.abspath(output_dir)
    return env


def remove(bootstrap_dir: str) -> None:
    shutil.rmtree(bootstrap_dir, ignore_errors=True)

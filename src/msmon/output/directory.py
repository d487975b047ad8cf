"""Where a rank's output goes, checked before training starts."""

from __future__ import annotations

import errno
import os
import tempfile

from ..config import ConfigError

ENV_OUTPUT_DIR = "MONITOR_OUTPUT_DIR"
DEFAULT_OUTPUT_DIR = "monitor_output"


def output_base_dir() -> str:
    """Where ranks write, absolute: a script may change its working directory after msmon
    attached, and every later write must still land where the job started."""
    return os.path.abspath(os.environ.get(ENV_OUTPUT_DIR) or DEFAULT_OUTPUT_DIR)


def ensure_writable(path: str) -> None:
    """Create `path` and prove a file can be written there, or fail with a clear error."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".msmon-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"output directory {os.path.abspath(path)} is not writable ({exc.strerror or exc}); "
            f"set {ENV_OUTPUT_DIR} to a writable directory"
        ) from None


def stopped_output(step: int, exc: OSError, path: str | None = None) -> dict:
    """What summary.json and the launcher keep of the write that stopped a rank's output."""
    return {
        "step": step,
        "errno": errno.errorcode.get(exc.errno) if exc.errno else None,
        "error": exc.strerror or str(exc),
        "path": exc.filename or path,
    }


def describe_stopped(info: dict) -> str:
    """'output stopped at step 7: No space left on device (ENOSPC) writing <path>'."""
    cause = info.get("error") or "write failed"
    if info.get("errno"):
        cause += f" ({info['errno']})"
    where = f" writing {info['path']}" if info.get("path") else ""
    return f"output stopped at step {info.get('step', '?')}: {cause}{where}"


def stopped_line(rank: int, info: dict) -> str:
    """The one line a rank logs when its output stops."""
    return f"msmon[rank {rank}]: {describe_stopped(info)}; nothing more is written to disk, training continues"

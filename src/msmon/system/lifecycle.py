"""Process-level concerns: logging, flushing every monitor at exit and on SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import weakref
from typing import Any, Callable

from . import exit_drain, process_end

_monitors: weakref.WeakSet[Any] = weakref.WeakSet()
_installed_pid: int | None = None  # the process whose monitors are closed at its end
_on_register: list[Callable[[Any], None]] = []  # told of every new TrainerMon (hooks/explicit.py)


def setup_logging() -> None:
    """Give msmon's logger a stderr handler once, so alerts and errors are seen."""
    logger = logging.getLogger("msmon")
    if logger.level == logging.NOTSET:
        logger.setLevel(os.environ.get("MSMON_LOG_LEVEL", "INFO").upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def on_register(callback: Callable[[Any], None]) -> None:
    """Call `callback(monitor)` for every TrainerMon built from now on."""
    _on_register.append(callback)


def register(monitor: Any) -> None:
    """Close `monitor` at the end of this process (process_end.py: a forked multiprocessing child
    too). A forked child's first monitor forgets the parent's: they are the parent's to close."""
    global _installed_pid
    if _installed_pid is not None and _installed_pid != os.getpid():
        _monitors.clear()
    _monitors.add(monitor)
    for callback in list(_on_register):
        try:
            callback(monitor)
        except Exception:  # never the script's TrainerMon's failure
            pass
    if _installed_pid == os.getpid():
        return
    _installed_pid = os.getpid()
    exit_drain.install()  # registered first, so it runs after close_all: its waits see the monitors' last work
    process_end.at_end(close_all)
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):
            pass


def close_all() -> None:
    for monitor in list(_monitors):
        try:
            monitor.close()
        except Exception:
            pass


def _on_sigterm(signum: int, frame: Any) -> None:
    """Write what is pending, then die of SIGTERM as the process would have."""
    close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)

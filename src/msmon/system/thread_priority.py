"""Run msmon's writer thread at the lowest CPU priority, so the training is never made to wait.

On a machine where the training keeps every core busy (torch's OpenMP team), the writer's few
milliseconds of formatting per step are taken from the training twice: its CPU time, and the
GIL, which the training thread asks back after every torch op and gets only when the writer
lets go. At nice 19 the scheduler runs the writer when a training thread waits rather than in
its place: on the reference model (2 cores, wg+mv+param) the monitored step went from x1.13 to
x1.09 of the plain one with the same writer CPU per step (docs/performance.md). Linux keeps a
nice value per thread, so only the calling thread changes; elsewhere nothing is changed (a
process-wide call there would slow the user's training instead).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger("msmon")

ENV = "MSMON_WRITER_NICE"
DEFAULT_NICE = 19


def writer_nice() -> int:
    """The nice value asked for msmon's writer thread: MSMON_WRITER_NICE, default 19; 0 keeps
    the priority it inherited."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_NICE
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: expected an integer nice value 0..19") from None
    if not 0 <= value <= 19:
        raise ValueError(f"{ENV}={text!r}: expected an integer nice value 0..19")
    return value


def lower_this_threads_priority(nice: int) -> bool:
    """Raise the calling thread's nice value by `nice` (Linux only: its nice value is the
    thread's own). Returns whether it changed; a refusal is logged at debug level."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except OSError as exc:
        logger.debug("msmon: the writer thread keeps its priority (%s)", exc)
        return False
    return True

"""How many threads the statistics use on the CPU, read from the environment when asked."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Threads:
    """How many threads the statistics use on the CPU (0: torch's own setting)."""

    stats: int  # MSMON_STAT_THREADS (default 1): the torch reductions; see _cpu_threads
    native: int  # MSMON_NATIVE_THREADS (default 0): the threads that may share one native call


_threads: Threads | None = None


def configure_threads() -> Threads:
    """Read MSMON_STAT_THREADS and MSMON_NATIVE_THREADS from the environment now (the monitor
    does at attach; statistics asked for before that read them at their first call)."""
    global _threads
    _threads = Threads(
        stats=int(os.environ.get("MSMON_STAT_THREADS", "1") or 0),
        native=int(os.environ.get("MSMON_NATIVE_THREADS", "0") or 0),
    )
    return _threads


def current() -> Threads:
    """The settings: those configured, else read from the environment now."""
    return _threads or configure_threads()


class _cpu_threads:
    """Run the CPU reductions on Threads.stats threads. Every parallel region costs a fork and
    a join of torch's thread pool; on a machine whose cores the training already keeps busy
    (and whose writer thread, data loader or neighbours take a core now and then) each join
    can wait for a preempted thread. The statistics are many short reductions, so they pay
    that far more often than the training does. Restored on exit (set_num_threads: 0.3 us)."""

    __slots__ = ("before", "threads")

    def __init__(self, device: torch.device) -> None:
        self.threads = (_threads or configure_threads()).stats
        self.before = torch.get_num_threads() if device.type == "cpu" and self.threads else 0

    def __enter__(self) -> None:
        if self.before and self.before != self.threads:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc) -> None:
        if self.before and self.before != self.threads:
            torch.set_num_threads(self.before)

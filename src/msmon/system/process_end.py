"""msmon's work at the end of a process, wherever the process really ends.

`atexit` runs at interpreter exit. A child that multiprocessing starts by forking (the fork and
forkserver start methods: `torch.multiprocessing.start_processes(start_method="fork")`, a
DataLoader worker) never gets there: once its target returns, multiprocessing runs its own
finalizers and ends the process with `os._exit`. So msmon's end-of-process work (closing the
monitors, draining collectives, the worker record's last word) is registered with both in any
multiprocessing child, and runs once, whichever comes first. Both run callbacks last in, first
out: `multiprocessing.util.Finalize` with one exit priority for all of msmon's runs them in the
reverse order of their registration, as atexit does.

A finalizer registered before multiprocessing's bootstrap of the child is lost (the bootstrap
clears the registry it inherited): code that runs in the parent registers its child's work with
`in_forked_children` instead.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any, Callable

EXIT_PRIORITY = 0  # multiprocessing runs finalizers of priority >= 0 before it joins the children left


class _Once:
    """`callback`, run at most once, whichever registration comes first."""

    def __init__(self, callback: Callable[[], Any]) -> None:
        self.callback: Callable[[], Any] | None = callback

    def __call__(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


def multiprocessing_child() -> bool:
    """Whether multiprocessing started this process (its parent_process is set)."""
    module = sys.modules.get("multiprocessing")
    return module is not None and module.parent_process() is not None


def at_end(callback: Callable[[], Any]) -> None:
    """Run `callback` when this process ends, before the callbacks registered earlier."""
    once = _Once(callback)
    atexit.register(once)
    if multiprocessing_child():
        from multiprocessing import util

        util.Finalize(None, once, exitpriority=EXIT_PRIORITY)


def in_forked_children(owner: object, callback: Callable[[], Any]) -> None:
    """Call `callback()` in every child multiprocessing forks from now on, at the start of its
    bootstrap (after it cleared the finalizers it inherited, before its target runs), while
    `owner` is alive (multiprocessing holds it weakly)."""
    from multiprocessing import util

    util.register_after_fork(owner, lambda _owner: callback())

"""Which TrainerMons are msmon's own: those built inside `building()` (attach.start_monitor).
Any other is the script's, and makes the automatic monitoring stand down (explicit.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()  # .depth: how many automatic monitors this thread is building


@contextmanager
def building() -> Iterator[None]:
    """TrainerMons built inside this block are msmon's own (attach.start_monitor)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def being_built() -> bool:
    """Whether this thread is building one of msmon's own TrainerMons now."""
    return bool(getattr(_local, "depth", 0))

"""Listeners of a process-wide wrap: a library's methods stay replaced while at least one listener
is registered, and are put back when the last one leaves (backward_calls.py: the loss of each
backward pass; grad_rewrites.py: a GradScaler's unscaling)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from .patching import Replacements

T = TypeVar("T")


class Listeners(Generic[T]):
    """The registered listeners (`items`, to iterate over a copy of) and what their wrap replaced.
    `on_last_gone` runs, under the lock, once the last one left and the methods are back."""

    def __init__(self, on_last_gone: Callable[[], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.items: list[T] = []
        self.replaced = Replacements()
        self._on_last_gone = on_last_gone

    def add(self, listener: T, install: Callable[[Replacements], None]) -> Listening:
        """Register `listener`; `install(replaced)` puts the wrappers in place (each at most once)."""
        with self.lock:
            self.items.append(listener)
            install(self.replaced)
        return Listening(self, listener)

    def remove(self, listener: Any) -> None:
        with self.lock:
            if listener in self.items:
                self.items.remove(listener)
            if not self.items:
                self.replaced.restore()
                if self._on_last_gone is not None:
                    self._on_last_gone()


@dataclass
class Listening:
    """A registration; `stop()` ends it (the last one puts the wrapped methods back)."""

    owner: Listeners[Any]
    listener: Any
    stopped: bool = field(default=False)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.owner.remove(self.listener)

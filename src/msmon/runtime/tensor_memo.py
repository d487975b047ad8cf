"""Something kept per tensor for the rest of the step, found again only for that very tensor.

The same tensor is met several times in a step: one module's output is usually the next one's
input, they share a gradient, and the non-finite origin looks at the tensors the activation
collector reads. A memo entry is found again only for the same object (a weak reference, so a
recycled id never matches) at the same version counter (unchanged since: after an in-place op
it is a new value). Used for the rows read this step (`StepContext.rows_read`) and for the
tensors given a gradient hook (msmon.runtime.grad_hooks); the monitor forgets them at step end.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

import torch

V = TypeVar("V")


class TensorMemo(Generic[V]):
    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, int, V]] = {}

    def get(self, t: torch.Tensor) -> V | None:
        entry = self._entries.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        return None

    def put(self, t: torch.Tensor, value: V) -> None:
        self._entries[id(t)] = (weakref.ref(t), t._version, value)

    def forget(self, t: torch.Tensor) -> None:
        """Drop the entry of `t` (its value changed without its version counter moving)."""
        entry = self._entries.get(id(t))
        if entry is not None and entry[0]() is t:
            del self._entries[id(t)]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

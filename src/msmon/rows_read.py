"""The statistics rows of the tensors read so far in this step, by tensor identity.

One module's output is usually the next one's input, and they share a gradient; the
non-finite origin flags the same tensors the activation collector reads. A row is found again
only for the very same tensor object (a weak reference, so a recycled id never matches) at the
same version counter (unchanged since it was read); the monitor forgets them all at step end.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class RowsRead:
    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: dict[int, tuple[Any, int, torch.Tensor]] = {}

    def get(self, t: torch.Tensor) -> torch.Tensor | None:
        entry = self._rows.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        return None

    def put(self, t: torch.Tensor, row: torch.Tensor) -> None:
        self._rows[id(t)] = (weakref.ref(t), t._version, row)

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)

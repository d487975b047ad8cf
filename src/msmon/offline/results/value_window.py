"""A window of one category's values placed in a dense array: (ranks, ops, tensors, steps,
micro-steps), ranks first, NaN where no value was written.

The arrays are taken from a Workspace that keeps them from window to window: a fresh array of
a few hundred MiB costs more to fault in than to fill, on every window. A value written twice
at the same place (a rank's step recorded again) is not lost: the repeats go to a second layer
of ranks (`layers`), each row of the rank axis knowing its rank (`slot_ranks`), so that a
maximum, a count or a median over ranks sees every value written, as a query over the rows does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class Unplaced(Exception):
    """A value the plan has no place for (a rank, tensor or op it does not list)."""


class Workspace:
    """Arrays reused from window to window, grown when a window needs more."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def take(self, name: str, size: int, dtype: type) -> np.ndarray:
        have = self._arrays.get(name)
        if have is None or have.size < size:
            have = self._arrays[name] = np.empty(size, dtype=dtype)
        return have[:size]


@dataclass
class Window:
    """One category's values at steps first..first+steps-1. Arrays (ranks x layers, ops, tensors,
    steps, micro): `value`; `present` where a value was written; `finite` where it is finite;
    `magnitude` |value| where finite, -1 elsewhere (so that a maximum needs no NaN test). Most
    windows are dense and finite: what only a gap or a non-finite value needs is skipped."""

    category: str
    first: int
    slot_ranks: np.ndarray  # the rank of each row of the rank axis
    layers: int
    value: np.ndarray
    present: np.ndarray
    finite: np.ndarray
    magnitude: np.ndarray
    dense: bool  # a value at every place: `present` is all true
    nonfinite: np.ndarray | None  # where a value was written and is not finite; None: nowhere

    @property
    def cells(self) -> int:
        """Cells per row of the rank axis: ops x tensors x steps x micro-steps."""
        return int(self.value[0].size)

    def flat(self, array: np.ndarray) -> np.ndarray:
        """`array` as (rank rows, cells)."""
        return array.reshape(array.shape[0], -1)


def place(
    space: Workspace,
    category: str,
    first: int,
    ranks: list[int],
    shape: tuple[int, int, int, int],
    at: np.ndarray,
    value: np.ndarray,
) -> Window:
    """The window's arrays from the values and their places (window_query's `at`); `shape` is
    (ops, tensors, steps, micro-steps)."""
    per_rank = int(np.prod(shape))
    size = len(ranks) * per_rank
    if at.size and (int(at.min()) < 0 or int(at.max()) >= size):
        raise Unplaced(category)
    layers = 1
    present = space.take("present", size, np.bool_)
    present.fill(False)
    present[at] = True
    written = int(np.count_nonzero(present))
    if written < at.size:  # a place written more than once
        at, layers = _layered(at, size)
        size *= layers
        present = space.take("present", size, np.bool_)
        present.fill(False)
        present[at] = True
        written = at.size
    full = space.take("value", size, np.float64)
    full[at] = value
    return settle(space, category, first, ranks, shape, layers, full, present, written)


def settle(
    space: Workspace,
    category: str,
    first: int,
    ranks: list[int],
    shape: tuple[int, int, int, int],
    layers: int,
    full: np.ndarray,
    present: np.ndarray,
    written: int,
) -> Window:
    """The window of the values already placed in `full` (flat, `layers` layers of ranks; other
    places hold anything), `present` where `written` of them were."""
    size = full.size
    dense = written == size
    if not dense:
        np.copyto(full, np.nan, where=~present)
    finite = space.take("finite", size, np.bool_)
    np.isfinite(full, out=finite)
    magnitude = space.take("magnitude", size, np.float64)
    np.abs(full, out=magnitude)
    nonfinite = None
    finite_count = int(np.count_nonzero(finite))
    if finite_count < size:
        np.copyto(magnitude, -1.0, where=~finite)
        if finite_count < written:  # a written value is not finite
            nonfinite = present & ~finite
    dims = (len(ranks) * layers, *shape)
    return Window(
        category,
        first,
        np.tile(np.asarray(ranks, dtype=np.int64), layers),
        layers,
        full.reshape(dims),
        present.reshape(dims),
        finite.reshape(dims),
        magnitude.reshape(dims),
        dense,
        None if nonfinite is None else nonfinite.reshape(dims),
    )


def _layered(at: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """Each value's place with its repeats moved to further layers (a layer: `size` cells)."""
    order = np.argsort(at, kind="stable")
    sorted_at = at[order]
    starts = np.flatnonzero(np.r_[True, sorted_at[1:] != sorted_at[:-1]])
    run_start = np.repeat(starts, np.diff(np.r_[starts, sorted_at.size]))
    layer = np.empty(at.size, dtype=np.int64)
    layer[order] = np.arange(at.size) - run_start
    return at.astype(np.int64) + layer * size, int(layer.max()) + 1

"""The row charts' points, one per rank, folded from the value windows in numpy.

A point is what a heatmap cell holds, for one rank: the largest finite |value| of the row's
tensors over the micro-steps and steps merged into one chart column, and whether any of them
was non-finite. A run has about half as many points as values when two steps make a column
(512 ranks x 200 steps x 200 tensors x 7 ops: 72 M points out of 143 M values): as a DuckDB
hash aggregation, one group per point, that took most of the report's time and 8 GiB. Here a
category's points are an array of ranks x ops x rows x columns (ranks first, as the windows
are), each window folded in by maxima over its micro-steps, the tensors of a row and the steps
of a column; the band, the medians and the robust z are reductions over the rank axis. It
follows what the page shows, not the run's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rank_stats import median_over_ranks, robust_z
from .value_window import Window


@dataclass
class Points:
    """A category's points: `v` the finite |value| (NaN where none), `bad` whether a value was
    non-finite; both (ranks, ops, rows, columns)."""

    ops: list[str]
    v: np.ndarray
    bad: np.ndarray

    def band(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(min, median, max, any non-finite) over ranks: each (ops, rows, columns); NaN where no
        rank has a finite value."""
        v = self.v
        return np.fmin.reduce(v, axis=0), median_over_ranks(v), np.fmax.reduce(v, axis=0), np.any(self.bad, axis=0)

    def departing(self, op: str, count: int, ranks: list[int]) -> list[list[int]]:
        """Per row, the `count` ranks with the largest robust z of their points on `op` over
        the ranks' median and MAD at each column (a non-finite point counts as the largest),
        largest first (ties: the lower rank); only ranks with z > 0."""
        i = self.ops.index(op)
        v, bad = self.v[:, i], self.bad[:, i]  # (ranks, rows, columns)
        z = np.fmax.reduce(np.where(bad, np.inf, robust_z(v)[0]), axis=2).T  # (rows, ranks); NaN: no point
        slots = np.asarray(ranks)
        out = []
        for row in z:
            keep = np.flatnonzero(row > 0)
            order = keep[np.lexsort((slots[keep], -row[keep]))][:count]
            out.append([int(slots[s]) for s in order])
        return out


def _fold_axes(array: np.ndarray, layers: int, ranks: int, per_row: int, combine: np.ufunc) -> np.ndarray:
    """(ranks x layers, ops, tensors, steps, micro) -> (ranks, ops, rows, steps): micro-steps,
    layers and the tensors of a row combined (views where there is nothing to combine)."""
    array = array[..., 0] if array.shape[4] == 1 else combine.reduce(array, axis=4)
    if layers > 1:
        array = combine.reduce(array.reshape(layers, ranks, *array.shape[1:]), axis=0)
    if per_row > 1:
        array = combine.reduceat(array, np.arange(0, array.shape[2], per_row), axis=2)
    return array


class PointsFold:
    """A category's points, folded in from its value windows: (ranks, ops, rows, columns), the
    rows `per_row` tensors each and the columns `width` steps each from `first` (the heatmap's)."""

    def __init__(self, ops: list[str], ranks: int, tensors: int, per_row: int, first: int, width: int, columns: int):
        self.ops, self.ranks, self.per_row = ops, ranks, per_row
        self.first, self.width = first, width
        rows = -(-tensors // per_row)
        self.largest = np.full((ranks, len(ops), rows, columns), -1.0)  # -1: no finite value
        self.bad = np.zeros(self.largest.shape, dtype=bool)
        self.seen_ops = np.zeros(len(ops), dtype=bool)  # the ops with a value in a window folded in

    def add(self, window: Window) -> None:
        """Fold in one window (its micro-steps, the tensors of a row and the steps of a column)."""
        if window.dense:
            self.seen_ops[:] = True
        else:
            self.seen_ops |= np.moveaxis(window.present, 1, 0).reshape(len(self.ops), -1).any(axis=1)
        largest = _fold_axes(window.magnitude, window.layers, self.ranks, self.per_row, np.maximum)
        bad = None
        if window.nonfinite is not None:
            bad = _fold_axes(window.nonfinite, window.layers, self.ranks, self.per_row, np.logical_or)
        skip, steps = window.first - self.first, largest.shape[3]  # steps of the heatmap before the window's
        for place in range(self.width):  # the steps at one place of their columns, strided: no copy
            i = (place - skip) % self.width
            if i >= steps:
                continue
            picked = largest[..., i :: self.width]
            column = (skip + i) // self.width
            span = slice(column, column + picked.shape[3])
            np.maximum(self.largest[..., span], picked, out=self.largest[..., span])
            if bad is not None:
                np.logical_or(self.bad[..., span], bad[..., i :: self.width], out=self.bad[..., span])

    def points(self, ops: list[str], factor: int) -> Points:
        """The points on `ops`, `factor` columns merged into one."""
        index = [self.ops.index(op) for op in ops]
        largest, bad = self.largest, self.bad
        if index != list(range(len(self.ops))):
            largest, bad = largest[:, index], bad[:, index]
        if factor > 1:
            starts = np.arange(0, largest.shape[3], factor)
            largest, bad = np.maximum.reduceat(largest, starts, axis=3), np.logical_or.reduceat(bad, starts, axis=3)
        return Points(ops, np.where(largest < 0, np.nan, largest), bad)

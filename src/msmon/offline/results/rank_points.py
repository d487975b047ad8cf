"""The row charts' points, one per rank, read a category at a time and reduced in numpy.

A point is what a heatmap cell holds, for one rank: the largest finite |value| of the row's
tensors over the micro-steps and steps merged into one chart column, and whether any of them
was non-finite. A run has about half as many points as values when two steps make a column
(512 ranks x 200 steps x 200 tensors x 7 ops: 72 M points out of 143 M values): as a DuckDB
hash aggregation, one group per point, that took most of the report's time and 8 GiB. Here
each category's values are read once, the category and ops a filter the scan applies, as
(the point's index in a dense array, |value| or -1 where non-finite), and folded in with
scatter_max; the band, the medians and the robust z are reductions over the array's rank axis.
The array holds a category's ranks x ops x rows x columns, ranks first: the values a Parquet
file or a CSV file holds are one rank's, so the places a run of them is folded into lie
together in memory (three times faster than ranks last). It follows what the page shows, not
the run's length.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .bulk import _quoted
from .robust import MAD_FLOOR, MAD_SCALE, TINY

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

RANK_SLOTS = "report_rank_slots"  # temp table: (rank, slot), the ranks' place on the array's last axis


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
        return np.fmin.reduce(v, axis=0), _median(v, axis=0), np.fmax.reduce(v, axis=0), np.any(self.bad, axis=0)

    def departing(self, op: str, count: int, ranks: list[int]) -> list[list[int]]:
        """Per row, the `count` ranks with the largest robust z of their points on `op` over
        the ranks' median and MAD at each column (a non-finite point counts as the largest),
        largest first (ties: the lower rank); only ranks with z > 0."""
        i = self.ops.index(op)
        v, bad = self.v[:, i], self.bad[:, i]  # (ranks, rows, columns)
        med = _median(v, axis=0)
        dev = np.abs(v - med)
        mad = _median(dev, axis=0)
        scale = np.fmax(np.fmax(MAD_SCALE * mad, MAD_FLOOR * np.abs(med)), TINY)
        z = np.fmax.reduce(np.where(bad, np.inf, dev / scale), axis=2).T  # (rows, ranks); NaN: no point
        slots = np.asarray(ranks)
        out = []
        for row in z:
            keep = np.flatnonzero(row > 0)
            order = keep[np.lexsort((slots[keep], -row[keep]))][:count]
            out.append([int(slots[s]) for s in order])
        return out


def _median(v: np.ndarray, axis: int) -> np.ndarray:
    """The median over `axis` of the values that are not NaN (NaN where none is), as DuckDB's
    median: the mean of the middle two of an even count. np.median where no value is NaN: it is
    several times faster than np.nanmedian."""
    if not np.isnan(v).any():
        return np.median(v, axis=axis)
    with warnings.catch_warnings():  # "All-NaN slice": a cell no rank has a finite value in
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(v, axis=axis)


def define_rank_slots(con: DuckDBPyConnection, ranks: list[int]) -> None:
    """The temp table RANK_SLOTS: each rank's slot, in the order of `ranks`."""
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE {RANK_SLOTS} AS SELECT unnest(?::INTEGER[]) AS rank, "
        "generate_subscripts(?::INTEGER[], 1) - 1 AS slot",
        [ranks, ranks],
    )


def category_points(
    con: DuckDBPyConnection, category: str, ops: list[str], rows: int, first: int, width: int, columns: int, ranks: int
) -> Points:
    """The points of `category` on `ops` (needs the temp tables heatmap_rows and RANK_SLOTS)."""
    op_index = " ".join(f"WHEN '{_quoted(op)}' THEN {i}" for i, op in enumerate(ops))
    listed = ", ".join(f"'{_quoted(op)}'" for op in ops)
    got = con.execute(f"""
        SELECT k.slot * {len(ops) * rows * columns} + ((CASE m.op {op_index} END) * {rows} + r.row) * {columns}
            + (m.step - {first}) // {width} AS at,
          CASE WHEN isfinite(m.value) THEN abs(m.value) ELSE -1.0 END AS v
        FROM metrics m JOIN heatmap_rows r USING (category, vpp_stage, name) JOIN {RANK_SLOTS} k USING (rank)
        WHERE m.category = '{_quoted(category)}' AND m.op IN ({listed}) AND m.value IS NOT NULL""").fetchnumpy()
    at, value = np.asarray(got.pop("at"), dtype=np.int64), np.asarray(got.pop("v"), dtype=np.float64)
    shape = (ranks, len(ops), rows, columns)
    v = np.full(int(np.prod(shape)), np.nan)
    bad = np.zeros(v.size, dtype=bool)
    finite = value >= 0
    bad[at[~finite]] = True
    scatter_max(v, at[finite], value[finite])
    return Points(ops, v.reshape(shape), bad.reshape(shape))


def scatter_max(out: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """out[at[i]] = max(out[at[i]], values[i]) for every i (out: nothing there yet, NaN), as
    np.fmax.at does, at a few times its speed: an assignment keeps one of the values that share a
    place, and those larger than what was kept are assigned again, until none is (as many
    rounds as values share a place at most: the steps, tensors and micro-steps of a point)."""
    out[at] = values
    while True:
        larger = values > out[at]
        if not larger.any():
            return
        at, values = at[larger], values[larger]
        out[at] = values

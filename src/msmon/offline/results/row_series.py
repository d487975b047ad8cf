"""A heatmap row over steps, rank by rank: the line chart a click on a row opens.

A point is what the heatmap's cell holds, for one rank: the largest finite |value| of the row's
tensors over micro-steps and merged steps, or non-finite. Up to Limits.line_ranks ranks every
rank has its line. Above, a row has the band of the ranks' min, median and max (the max is
non-finite where any rank's value was) and the lines of the Limits.outlier_lines ranks that
depart most from the median (robust z, robust.py; chosen per category and row on one op, the
first of OPS the category has, and drawn for every op), so the page does not grow with ranks.
All charts together hold at most Limits.series_values values: past that, neighbouring steps
are merged in the charts (the heatmaps keep their own columns). That is decided before the
values are read, counting a chart per category and configured op and a line per rank with files.

The points are folded from the values with everything else the page needs (value_fold.py).

Values travel like heatmap cells: uint16 codes on a log scale of the heatmap's own chart range,
base64, [row][line][column].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cells import encode_cells
from .limits import Limits
from .schema import OPS

if TYPE_CHECKING:  # numpy (the db extra) is imported when a report is built, not when msmon starts
    import numpy as np

    from .rank_points import PointsFold

BAND_LINES = ("min", "median", "max")


@dataclass
class SeriesLayout:
    """How the row charts are drawn, decided before any value is read (from the plan: the
    ranks, each category's rows and the configured ops), so that a category's charts are made as
    soon as its values are folded and its per-rank points let go."""

    mode: str  # "lines": a line per rank; "band": min, median, max and the departing ranks
    ranks: list[int]
    lines: int
    factor: int  # heatmap columns merged into one chart column
    step_width: int
    columns: int

    @classmethod
    def of(cls, limits: Limits, ranks: list[int], charts_rows: int, step_width: int, columns: int) -> SeriesLayout:
        """`charts_rows`: the rows of every heatmap together (a heatmap per category and op)."""
        mode = "lines" if len(ranks) <= limits.line_ranks else "band"
        lines = len(ranks) if mode == "lines" else len(BAND_LINES) + limits.outlier_lines
        factor = max(1, math.ceil(charts_rows * max(1, lines) * columns / limits.series_values))
        return cls(mode, ranks, lines, factor, step_width * factor, math.ceil(columns / factor))

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "ranks": len(self.ranks),
            "step_width": self.step_width,
            "columns": self.columns,
        }
        if self.mode == "lines":
            out["line_ranks"] = self.ranks
        return out


def category_series(
    limits: Limits, layout: SeriesLayout, points: PointsFold, ops: list[str]
) -> dict[str, dict[str, Any]]:
    """The charts of one category's rows, per op of `ops`, from its folded points."""
    import numpy as np

    got = points.points(ops, layout.factor)
    if layout.mode == "lines":
        return {
            op: _series(got.v[:, i].transpose(1, 0, 2), got.bad[:, i].transpose(1, 0, 2)) for i, op in enumerate(ops)
        }
    lo, med, hi, bad = got.band()
    departing = got.departing(min(ops, key=_op_order), limits.outlier_lines, layout.ranks)
    slot = {rank: i for i, rank in enumerate(layout.ranks)}
    out = {}
    for i, op in enumerate(ops):
        v = np.full((got.v.shape[2], layout.lines, got.v.shape[3]), np.nan)
        flagged = np.zeros(v.shape, dtype=bool)
        v[:, 0], v[:, 1], v[:, 2], flagged[:, 2] = lo[i], med[i], hi[i], bad[i]
        for row, chosen_ranks in enumerate(departing):
            for j, rank in enumerate(chosen_ranks):
                v[row, len(BAND_LINES) + j] = got.v[slot[rank], i, row]
                flagged[row, len(BAND_LINES) + j] = got.bad[slot[rank], i, row]
        out[op] = _series(v, flagged)
        out[op]["outliers"] = departing
    return out


def _series(v: np.ndarray, bad: np.ndarray) -> dict[str, Any]:
    """A heatmap's charts from (rows, lines, columns) arrays of points (NaN: none)."""
    cells = [
        [(None if x != x else x, b) for x, b in zip(xs, bs)]
        for xs, bs in zip(v.reshape(-1, v.shape[2]).tolist(), bad.reshape(-1, v.shape[2]).tolist())
    ]
    data, lo, hi = encode_cells(cells)
    return {"lines": v.shape[1], "data": data, "lo": lo, "hi": hi}


def _op_order(op: str) -> tuple[int, str]:
    return (OPS.index(op) if op in OPS else len(OPS), op)

"""A heatmap row over steps, rank by rank: the line chart a click on a row opens.

A point is what the heatmap's cell holds, for one rank: the largest finite |value| of the row's
tensors over micro-steps and merged steps, or non-finite. Up to Limits.line_ranks ranks every
rank has its line. Above, a row has the band of the ranks' min, median and max (the max is
non-finite where any rank's value was) and the lines of the Limits.outlier_lines ranks that
depart most from the median (robust z, robust.py; chosen per category and row on one op, the
first of OPS the category has, and drawn for every op), so the page does not grow with ranks.
All charts together hold at most Limits.series_values values: past that, neighbouring steps
are merged in the charts (the heatmaps keep their own columns).

The points are folded from the values with everything else the page needs (value_fold.py).

Values travel like heatmap cells: uint16 codes on a log scale of the heatmap's own chart range,
base64, [row][line][column].
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .cells import encode_cells
from .limits import Limits
from .schema import OPS

if TYPE_CHECKING:  # numpy (the db extra) is imported when a report is built, not when msmon starts
    import numpy as np

    from .value_fold import Folded

BAND_LINES = ("min", "median", "max")


def row_series(limits: Limits, maps: list[dict[str, Any]], steps: dict[str, Any], folded: Folded) -> dict[str, Any]:
    """Adds "series" to each heatmap of `maps` from the folded points; returns how the charts
    were made: their mode, ranks, step width and columns."""

    ranks = folded.ranks
    columns, width = steps["columns"], steps["step_width"]
    mode = "lines" if len(ranks) <= limits.line_ranks else "band"
    lines = len(ranks) if mode == "lines" else len(BAND_LINES) + limits.outlier_lines
    needed = sum(len(m["rows"]) for m in maps) * max(1, lines) * columns
    factor = max(1, math.ceil(needed / limits.series_values))
    info = {"mode": mode, "ranks": len(ranks), "step_width": width * factor, "columns": math.ceil(columns / factor)}
    if not maps or not columns:
        return info
    import numpy as np

    by_category: dict[str, list[dict[str, Any]]] = {}
    for heatmap in maps:
        by_category.setdefault(heatmap["category"], []).append(heatmap)
    for category, chosen in by_category.items():
        ops = [h["op"] for h in chosen]
        points = folded.points[category].points(folded.slots, ops, factor)
        if mode == "lines":
            for i, heatmap in enumerate(chosen):
                heatmap["series"] = _series(points.v[:, i].transpose(1, 0, 2), points.bad[:, i].transpose(1, 0, 2))
            continue
        lo, med, hi, bad = points.band()
        departing = points.departing(min(ops, key=_op_order), limits.outlier_lines, ranks)
        slot = {rank: i for i, rank in enumerate(ranks)}
        for i, heatmap in enumerate(chosen):
            v = np.full((len(heatmap["rows"]), lines, info["columns"]), np.nan)
            flagged = np.zeros(v.shape, dtype=bool)
            v[:, 0], v[:, 1], v[:, 2], flagged[:, 2] = lo[i], med[i], hi[i], bad[i]
            for row, chosen_ranks in enumerate(departing):
                for j, rank in enumerate(chosen_ranks):
                    v[row, len(BAND_LINES) + j] = points.v[slot[rank], i, row]
                    flagged[row, len(BAND_LINES) + j] = points.bad[slot[rank], i, row]
            heatmap["series"] = _series(v, flagged)
            heatmap["series"]["outliers"] = departing
    if mode == "lines":
        info["line_ranks"] = ranks
    return info


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

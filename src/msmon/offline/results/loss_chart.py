"""The report's loss chart: the loss of every rank over steps and micro-steps.

The rows are the `loss` category (`loss_*.csv`, column `value`, one row per micro-step per
rank; `"loss_distribution": true`). Up to Limits.line_ranks ranks, a line per rank; above, the
band of the ranks' min, median and max, with the lines of the Limits.outlier_lines ranks that
depart most from the median (robust.py), so the page stays the same size at any number of
ranks. Up to Limits.loss_points points per line: a longer run is shown as the mean of
neighbouring steps' losses (non-finite where any of them was, as a heatmap cell).
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from .limits import Limits
from .robust import robust_z
from .sql import one_row

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

LOSS_CATEGORY = "loss"
LOSS_COLUMN = "value"

_NONFINITE = """CASE WHEN bool_or(isnan(value)) THEN 'nan' WHEN bool_or(value = 'inf'::DOUBLE) THEN 'inf'
  WHEN bool_or(value = '-inf'::DOUBLE) THEN '-inf' END"""


def number(value: float | None) -> float | str | None:
    """A value for the page's JSON, as recorded (the loss to the last digit); a non-finite one as
    its name."""
    if value is None:
        return None
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return float(value)


def loss_chart(con: DuckDBPyConnection, limits: Limits) -> dict[str, Any]:
    """The chart's points (x in steps) and lines, or {"points": 0} when no loss was recorded."""
    where = f"category = '{LOSS_CATEGORY}' AND op = '{LOSS_COLUMN}'"
    first, last, micros, points, ranks = one_row(
        con.execute(
            "SELECT min(step), max(step), max(coalesce(micro_step, 0)) + 1, "
            f"count(DISTINCT (step, coalesce(micro_step, 0))), count(DISTINCT rank) FROM metrics WHERE {where}"
        )
    )
    if not points:
        return {"points": 0}
    if points <= limits.loss_points:
        width = 0  # every micro-step its own point
        key = f"step * {micros} + coalesce(micro_step, 0)"
    else:
        width = max(1, math.ceil((last - first + 1) / limits.loss_points))
        key = f"(step - {first}) // {width}"
    rows = con.execute(f"""
        SELECT {key} AS k, rank, avg(value) FILTER (WHERE isfinite(value)), {_NONFINITE}
        FROM metrics WHERE {where} GROUP BY ALL ORDER BY k, rank""").fetchall()
    keys = sorted({r[0] for r in rows})
    index = {k: i for i, k in enumerate(keys)}
    by_rank: dict[int, list[float | str | None]] = {}
    for k, rank, value, nonfinite in rows:
        line = by_rank.setdefault(rank, [None] * len(keys))
        line[index[k]] = nonfinite if nonfinite else number(value)
    xs = [k / micros for k in keys] if width == 0 else [first + k * width for k in keys]
    chart: dict[str, Any] = {
        "points": len(keys),
        "x": [number(x) for x in xs],
        "first_step": first,
        "last_step": last,
        "micro_steps": micros,
        "step_width": width,  # 0: one point per micro-step; else the mean over this many steps
        "ranks": ranks,
    }
    if ranks <= limits.line_ranks:
        chart["mode"] = "lines"
        chart["lines"] = [{"rank": r, "values": by_rank[r]} for r in sorted(by_rank)]
        return chart
    chart["mode"] = "band"
    chart["band"], departs = _band(by_rank, len(keys))
    worst = sorted(departs, key=lambda r: (-departs[r], r))[: limits.outlier_lines]
    chart["lines"] = [{"rank": r, "values": by_rank[r], "z": number(departs[r])} for r in worst if departs[r] > 0]
    return chart


def _band(by_rank: dict[int, list[float | str | None]], points: int) -> tuple[dict[str, list[Any]], dict[int, float]]:
    """Min, median and max over ranks per point, the ranks whose loss is non-finite there, and
    each rank's largest robust z over the points (inf where its loss was non-finite)."""
    band: dict[str, list[Any]] = {"min": [], "median": [], "max": [], "nonfinite": []}
    departs = dict.fromkeys(by_rank, 0.0)
    for i in range(points):
        finite = [(r, value) for r, v in by_rank.items() if isinstance(value := v[i], float)]
        bad = [r for r, v in by_rank.items() if isinstance(v[i], str)]
        values = [v for _, v in finite]
        band["min"].append(number(min(values)) if values else None)
        band["median"].append(number(statistics.median(values)) if values else None)
        band["max"].append(number(max(values)) if values else None)
        band["nonfinite"].append(len(bad))
        for (rank, _), z in zip(finite, robust_z(values)):
            departs[rank] = max(departs[rank], z)
        for rank in bad:
            departs[rank] = math.inf
    return band, departs

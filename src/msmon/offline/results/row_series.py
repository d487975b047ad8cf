"""A heatmap row over steps, rank by rank: the line chart a click on a row opens.

A point is what the heatmap's cell holds, for one rank: the largest finite |value| of the row's
tensors over micro-steps and merged steps, or non-finite. Up to Limits.line_ranks ranks every
rank has its line. Above, a row has the band of the ranks' min, median and max (the max is
non-finite where any rank's value was) and the lines of the Limits.outlier_lines ranks that
depart most from the median (robust z, robust.py; chosen per category and row on one op, the
first of OPS the category has, and drawn for every op), so the page does not grow with ranks.
All charts together hold at most Limits.series_values values: past that, neighbouring steps
are merged in the charts (the heatmaps keep their own columns).

Values travel like heatmap cells: uint16 codes on a log scale of the heatmap's own chart range,
base64, [row][line][column].
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .cells import encode_cells
from .limits import Limits
from .robust import SQL_Z
from .schema import OPS

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

BAND_LINES = ("min", "median", "max")

Point = tuple[float | None, bool]  # the finite |value| (or None), and whether it was non-finite


def row_series(
    con: DuckDBPyConnection, limits: Limits, maps: list[dict[str, Any]], steps: dict[str, Any], ranks: list[int]
) -> dict[str, Any]:
    """Adds "series" to each heatmap of `maps` (needs the temp table heatmap_rows); returns how
    the charts were made: their mode, ranks, step width and columns."""

    columns, width, first = steps["columns"], steps["step_width"], steps["first_step"]
    mode = "lines" if len(ranks) <= limits.line_ranks else "band"
    lines = len(ranks) if mode == "lines" else len(BAND_LINES) + limits.outlier_lines
    needed = sum(len(m["rows"]) for m in maps) * max(1, lines) * columns
    factor = max(1, math.ceil(needed / limits.series_values))
    info = {"mode": mode, "ranks": len(ranks), "step_width": width * factor, "columns": math.ceil(columns / factor)}
    if not maps or not columns:
        return info
    _per_rank_points(con, first, info["step_width"])
    points: dict[tuple[str, str], dict[tuple[int, int, int], Point]] = {}
    outliers: dict[tuple[str, int], list[int]] = {}
    if mode == "lines":
        slot = {rank: i for i, rank in enumerate(ranks)}
        for category, op, row, b, rank, v, bad in con.execute("SELECT * FROM series_rank").fetchall():
            points.setdefault((category, op), {})[(row, slot[rank], b)] = (v, bool(bad))
    else:
        _band_points(con, points)
        outliers = _outlier_ranks(con, maps, limits.outlier_lines)
        for category, op, row, b, rank, v, bad in con.execute("""
                SELECT s.* FROM series_rank s JOIN outlier_ranks o USING (category, row, rank)""").fetchall():
            line = len(BAND_LINES) + outliers[(category, row)].index(rank)
            points.setdefault((category, op), {})[(row, line, b)] = (v, bool(bad))
    con.execute("DROP VIEW series_rank")
    con.execute("DROP TABLE series_merged")
    for heatmap in maps:
        table = points.get((heatmap["category"], heatmap["op"]), {})
        grid = [
            [table.get((row, line, b), (None, False)) for b in range(info["columns"])]
            for row in range(len(heatmap["rows"]))
            for line in range(lines)
        ]
        data, lo, hi = encode_cells(grid)
        series: dict[str, Any] = {"lines": lines, "data": data, "lo": lo, "hi": hi}
        if mode == "band":
            series["outliers"] = [outliers.get((heatmap["category"], row), []) for row in range(len(heatmap["rows"]))]
        heatmap["series"] = series
    if mode == "lines":
        info["line_ranks"] = ranks
    return info


def _per_rank_points(con: DuckDBPyConnection, first: int, width: int) -> None:
    """The view series_rank: (category, op, row, b, rank, v, bad), one point per rank. A rank's
    point is one value of the long table where nothing is merged into it (one step per column,
    one tensor per row, one micro-step): those are read straight from the table each time, as a
    hash aggregation over every value costs ten times the scan. Only categories where several
    values make one point are aggregated, into a table."""
    if width > 1:
        merged = {r[0] for r in con.execute("SELECT DISTINCT category FROM heatmap_rows").fetchall()}
    else:
        merged = {
            r[0]
            for r in con.execute("""
            SELECT DISTINCT category FROM heatmap_rows GROUP BY category, row HAVING count(*) > 1
            UNION SELECT DISTINCT category FROM per_step GROUP BY category, op, vpp_stage, name, step
              HAVING count(*) > 1""").fetchall()
        }
    point = f"r.category, m.op, r.row, (m.step - {first}) // {width} AS b, m.rank"
    source = "FROM metrics m JOIN heatmap_rows r USING (category, vpp_stage, name)"
    # category names are file-name words (records/layout.py's CSV_FILE); '' stands for none
    categories = ", ".join(f"'{c}'" for c in sorted(merged)) or "''"
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE series_merged AS
        SELECT {point}, max(abs(m.value)) FILTER (WHERE isfinite(m.value)) AS v, bool_or(NOT isfinite(m.value)) AS bad
        {source} WHERE r.category IN ({categories}) GROUP BY ALL""")
    con.execute(f"""
        CREATE OR REPLACE TEMP VIEW series_rank AS
        SELECT {point}, CASE WHEN isfinite(m.value) THEN abs(m.value) END AS v, NOT isfinite(m.value) AS bad
        {source} WHERE r.category NOT IN ({categories})
        UNION ALL SELECT * FROM series_merged""")


def _band_points(con: DuckDBPyConnection, points: dict[tuple[str, str], dict[tuple[int, int, int], Point]]) -> None:
    for category, op, row, b, lo, med, hi, bad in con.execute("""
            SELECT category, op, row, b, min(v), median(v), max(v), bool_or(bad) FROM series_rank
            GROUP BY ALL""").fetchall():
        table = points.setdefault((category, op), {})
        table[(row, 0, b)] = (lo, False)
        table[(row, 1, b)] = (med, False)
        table[(row, 2, b)] = (hi, bool(bad))


def _outlier_ranks(con: DuckDBPyConnection, maps: list[dict[str, Any]], count: int) -> dict[tuple[str, int], list[int]]:
    """Per category and row, the `count` ranks with the largest robust z over the row's points
    (a non-finite value counts as the largest), on the category's first op in OPS order."""
    chosen: dict[str, str] = {}
    for heatmap in maps:
        current = chosen.get(heatmap["category"])
        if current is None or _op_order(heatmap["op"]) < _op_order(current):
            chosen[heatmap["category"]] = heatmap["op"]
    pairs = " OR ".join(f"(category = '{c}' AND op = '{o}')" for c, o in chosen.items()) or "false"
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE outlier_ranks AS
        WITH base AS (SELECT * FROM series_rank WHERE {pairs}),
        m AS (SELECT category, row, b, median(v) AS med FROM base GROUP BY ALL),
        d AS (SELECT base.*, m.med, abs(base.v - m.med) AS dev FROM base JOIN m USING (category, row, b)),
        a AS (SELECT category, row, b, median(dev) AS mad FROM d GROUP BY ALL),
        z AS (
          SELECT d.category, d.row, d.rank,
            max(CASE WHEN d.bad THEN 'inf'::DOUBLE ELSE {SQL_Z} END) AS z
          FROM d JOIN a USING (category, row, b) GROUP BY ALL)
        SELECT category, row, rank, z FROM z WHERE z > 0
        QUALIFY row_number() OVER (PARTITION BY category, row ORDER BY z DESC, rank) <= {count}""")
    out: dict[tuple[str, int], list[int]] = {}
    for category, row, rank in con.execute(
        "SELECT category, row, rank FROM outlier_ranks ORDER BY category, row, z DESC, rank"
    ).fetchall():
        out.setdefault((category, row), []).append(rank)
    return out


def _op_order(op: str) -> tuple[int, str]:
    return (OPS.index(op) if op in OPS else len(OPS), op)

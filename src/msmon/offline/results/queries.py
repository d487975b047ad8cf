"""What `msmon report` shows, computed from the database with a bounded result.

Heatmap rows follow `tensors.position`, the order the monitor wrote the tensors in.
The values are read once (value_fold.py), which leaves `per_step` (a temp table, per_step_fold.py):
for each tensor, op, step and micro-step, the largest finite |value| over ranks and its rank,
whether any rank had a non-finite one, the lowest such rank and which non-finite value it was,
and for replicated tensors the finite min and max with their ranks. The loss and the gradient
agreement have charts of their own (loss_chart.py, agreement_chart.py), not heatmaps. Heatmaps,
top movers and the rank spread are read from per_step, so their cost follows tensors x steps,
not ranks. Whatever the size of the run, a heatmap has at most `max_rows` x `max_steps` cells:
neighbouring steps (and tensors, in the order the monitor wrote them) are merged, keeping the
largest value, and the page says so.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import TYPE_CHECKING, Any

from ...anomaly.robust_spread import MAD_SCALE
from ...records.rows import REPLICATED_CATEGORIES, TENSOR_CATEGORIES
from .action_spans import action_spans
from .agreement_chart import AGREEMENT_CATEGORY, agreement_chart
from .anomaly_queries import anomalies, first_nonfinite
from .bulk import insert_rows
from .cells import encode_cells, encode_ranks
from .limits import Limits
from .loss_chart import LOSS_CATEGORY, loss_chart
from .schema import OPS
from .sql import one_row

if TYPE_CHECKING:  # duckdb and numpy (the db extra) are imported when a report is built, not when msmon starts
    from duckdb import DuckDBPyConnection

    from .value_fold import Folded

# categories drawn by a chart of their own, not as heatmaps (the agreement's signed cos is no |value|)
OWN_CHARTS = f"'{LOSS_CATEGORY}', '{AGREEMENT_CATEGORY}'"


def _categories(con: DuckDBPyConnection) -> list[str]:
    found = [r[0] for r in con.execute("SELECT DISTINCT category FROM per_step").fetchall()]
    return sorted(
        found, key=lambda c: (TENSOR_CATEGORIES.index(c) if c in TENSOR_CATEGORIES else len(TENSOR_CATEGORIES), c)
    )


def _ops(con: DuckDBPyConnection, category: str) -> list[str]:
    found = [r[0] for r in con.execute("SELECT DISTINCT op FROM per_step WHERE category = ?", [category]).fetchall()]
    return sorted(found, key=lambda o: (OPS.index(o) if o in OPS else len(OPS), o))


def overview(con: DuckDBPyConnection) -> dict[str, Any]:
    steps = one_row(con.execute("SELECT min(step), max(step), count(DISTINCT step) FROM per_step"))
    ranks = one_row(
        con.execute("SELECT count(DISTINCT rank) FROM files WHERE kind IN ('csv', 'tensorboard', 'parquet')")
    )[0]
    dirs = one_row(
        con.execute("SELECT count(DISTINCT rank_dir) FROM files WHERE kind IN ('csv', 'tensorboard', 'parquet')")
    )[0]
    doubled = [
        r[0]
        for r in con.execute(
            "SELECT rank FROM files WHERE kind IN ('csv', 'tensorboard', 'parquet') GROUP BY rank "
            "HAVING count(DISTINCT rank_dir) > 1 ORDER BY rank"
        ).fetchall()
    ]
    tensors = one_row(con.execute("SELECT count(*) FROM (SELECT DISTINCT category, vpp_stage, name FROM per_step)"))[0]
    roots = con.execute("SELECT value FROM meta WHERE key = 'roots'").fetchone()
    return {
        "ranks": ranks,
        "rank_dirs": dirs,
        "ranks_with_several_dirs": doubled[:20],
        "several_dirs": len(doubled),
        "first_step": steps[0],
        "last_step": steps[1],
        "steps": steps[2],
        "tensors": tensors,
        "values": one_row(con.execute("SELECT count(*) FROM metrics"))[0],
        "files": one_row(con.execute("SELECT count(*) FROM files"))[0],
        "anomalies": one_row(con.execute("SELECT count(*) FROM anomalies"))[0],
        "histograms": one_row(con.execute("SELECT count(*) FROM histograms"))[0],
        "roots": json.loads(roots[0]) if roots else [],
        "categories": _categories(con),
    }


def _label(vpp: int, name: str, several_vpp: bool) -> str:
    return f"{vpp}:{name}" if several_vpp else name


def heatmaps(
    con: DuckDBPyConnection, limits: Limits, folded: Folded, tmp_dir: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One heatmap per category and op: tensors (rows, in the order the monitor wrote them) x
    steps (columns); a cell is the largest finite |value| over ranks, micro-steps and the
    tensors and steps merged into it, or non-finite when any of them was, with the rank that
    holds it (for a non-finite cell, the lowest rank with a non-finite value). Leaves the
    temp table heatmap_rows (which row each tensor is in) for the line charts."""
    first, width, columns = folded.steps.first, folded.steps.width, folded.steps.columns
    out: list[dict[str, Any]] = []
    if not columns:
        return out, {"first_step": first, "step_width": width, "columns": 0}
    tensors, per_row = folded.tensors, folded.per_row
    rows: list[tuple[str, int, str, int]] = []
    labels: dict[str, list[str]] = {}
    for category, names in tensors.items():
        several_vpp = len({vpp for vpp, _ in names}) > 1
        group = per_row[category]
        labels[category] = []
        for i in range(0, len(names), group):
            g = names[i : i + group]
            head = _label(*g[0], several_vpp)
            labels[category].append(head if len(g) == 1 else f"{head} … {_label(*g[-1], several_vpp)} ({len(g)})")
            rows += [(category, vpp, name, i // group) for vpp, name in g]
    con.execute(
        "CREATE OR REPLACE TEMP TABLE heatmap_rows (category VARCHAR, vpp_stage INTEGER, name VARCHAR, row INTEGER)"
    )
    insert_rows(
        con,
        "heatmap_rows",
        [("category", "VARCHAR"), ("vpp_stage", "INTEGER"), ("name", "VARCHAR"), ("row", "INTEGER")],
        rows,
        tmp_dir,
    )
    cells: dict[tuple[str, str], dict[tuple[int, int], tuple[float | None, bool]]] = {}
    holders: dict[tuple[str, str], dict[tuple[int, int], int | None]] = {}
    for category, op, row, b, v, bad, v_rank, bad_rank in con.execute(f"""
            SELECT p.category, p.op, r.row, (p.step - {first}) // {width} AS b, max(p.v), bool_or(p.bad),
              arg_max(p.v_rank, p.v), min(p.bad_rank)
            FROM per_step p JOIN heatmap_rows r USING (category, vpp_stage, name) GROUP BY ALL""").fetchall():
        cells.setdefault((category, op), {})[(row, b)] = (v, bool(bad))
        holders.setdefault((category, op), {})[(row, b)] = bad_rank if bad else v_rank
    for category in _categories(con):
        for op in _ops(con, category):
            table = cells.get((category, op), {})
            grid = [[table.get((r, b), (None, False)) for b in range(columns)] for r in range(len(labels[category]))]
            data, lo, hi = encode_cells(grid)
            held = holders.get((category, op), {})
            ranks = [held.get((r, b)) for r in range(len(labels[category])) for b in range(columns)]
            out.append(
                {
                    "category": category,
                    "op": op,
                    "rows": labels[category],
                    "tensors": len(tensors[category]),
                    "tensors_per_row": per_row[category],
                    "data": data,
                    "ranks": encode_ranks(ranks),
                    "lo": lo,
                    "hi": hi,
                }
            )
    return out, {"first_step": first, "step_width": width, "columns": columns}


ONSET_K = 5.0  # a change this many robust deviations above the category's usual ones is unusual
ONSET_FLOOR = math.log10(4.0)  # and at least a factor of 4: a healthy bias gradient can double from step to step


def movers(con: DuckDBPyConnection, limits: Limits) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The largest step-to-step changes of max |value| over ranks, per category and op, with the
    rank that holds the value on each side; a step where a value turned non-finite (or finite
    again) is a change too, flagged, and listed first, earliest first. The first unusual change
    is always listed (`first_unusual`): the earliest step whose change of some tensor is more
    than ONSET_K robust deviations (1.4826 MAD of log10 |factor|) above the category's median
    change and at least ONSET_FLOOR, so that a fault's beginning is shown even when larger
    changes follow it (a run that diverges after the fault fills the list with those)."""
    rows = con.execute(f"""
        WITH s AS (
          SELECT category, op, vpp_stage, name, step, max(v) AS v, arg_max(v_rank, v) AS v_rank,
            bool_or(bad) AS bad, min(bad_rank) AS bad_rank, max(nf) AS nf
          FROM per_step GROUP BY ALL),
        l AS (
          SELECT *, lag(v) OVER w AS pv, lag(step) OVER w AS ps, lag(bad) OVER w AS pbad,
            lag(v_rank) OVER w AS pv_rank, lag(bad_rank) OVER w AS pbad_rank, lag(nf) OVER w AS pnf FROM s
          WINDOW w AS (PARTITION BY category, op, vpp_stage, name ORDER BY step)),
        scored AS (
          SELECT *, CASE WHEN bad <> pbad THEN 1 ELSE 0 END AS flagged,
            CASE WHEN bad = pbad THEN abs(log10(v) - log10(pv)) END AS score FROM l
          WHERE ps IS NOT NULL AND (bad <> pbad OR (NOT bad AND v > 0 AND pv > 0))),
        usual AS (
          SELECT category, op, greatest(median(score) + {ONSET_K} * {MAD_SCALE} * mad(score), {ONSET_FLOOR}) AS t
          FROM scored WHERE flagged = 0 GROUP BY ALL),
        onset AS (  -- the earliest unusual change of each category and op: its largest at that step
          SELECT c.category, c.op, arg_min(c.step, (c.step, -c.score)) AS step,
            arg_min(c.name, (c.step, -c.score)) AS name, arg_min(c.vpp_stage, (c.step, -c.score)) AS vpp_stage
          FROM scored c JOIN usual u USING (category, op) WHERE c.flagged = 0 AND c.score > u.t GROUP BY ALL),
        ranked AS (
          SELECT c.*, row_number() OVER (PARTITION BY c.category, c.op, c.flagged
              ORDER BY CASE WHEN c.flagged = 1 THEN c.step END, c.score DESC, c.step, c.name) AS place,
            o.step IS NOT NULL AS first_unusual
          FROM scored c LEFT JOIN onset o
            ON (c.category, c.op, c.step, c.name, c.vpp_stage) = (o.category, o.op, o.step, o.name, o.vpp_stage)
            AND c.flagged = 0)
        SELECT category, op, vpp_stage, name, ps, step, pv, v, score, flagged,
          CASE WHEN pbad THEN pbad_rank ELSE pv_rank END, CASE WHEN bad THEN bad_rank ELSE v_rank END,
          CASE WHEN pbad THEN pnf END, CASE WHEN bad THEN nf END, first_unusual
        FROM ranked WHERE place <= {limits.movers} OR first_unusual
        ORDER BY category, op, flagged DESC, CASE WHEN flagged = 1 THEN step END, score DESC, step, name
        """).fetchall()
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for category, op, vpp, name, ps, step, pv, v, score, flagged, p_rank, rank, p_bad, bad, onset in rows:
        p_nf, nf = _nonfinite_name(p_bad), _nonfinite_name(bad)
        out.setdefault(category, {}).setdefault(op, []).append(
            {
                "name": name,
                "vpp_stage": vpp,
                "from_step": ps,
                "step": step,
                "before": None if p_nf else pv,
                "after": None if nf else v,
                "before_rank": p_rank,
                "after_rank": rank,
                "before_nonfinite": p_nf,
                "after_nonfinite": nf,
                "factor": None if flagged else (10**score if v >= pv else -(10**score)),
                "first_unusual": bool(onset),
            }
        )
    return out


def _nonfinite_name(value: float | None) -> str | None:
    if value is None:
        return None
    return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def rank_spread(con: DuckDBPyConnection, limits: Limits, first: int, width: int) -> dict[str, Any]:
    """Replicated tensors across ranks: max - min of each statistic at the same (micro-)step."""
    replicated = ", ".join(f"'{c}'" for c in REPLICATED_CATEGORIES)
    base = f"""
        SELECT *, hi - lo AS spread, (hi - lo) / greatest(abs(hi), abs(lo), 1e-30) AS rel FROM per_step
        WHERE n > 1 AND category IN ({replicated}) AND lo IS NOT NULL"""
    compared = one_row(
        con.execute(f"SELECT count(*), count(DISTINCT (category, vpp_stage, name)), max(n) FROM ({base})")
    )
    top = con.execute(f"""
        SELECT category, op, vpp_stage, name, max(rel) AS rel, arg_max(step, rel), arg_max(spread, rel),
          arg_max(lo, rel), arg_max(hi, rel), arg_max(lo_rank, rel), arg_max(hi_rank, rel), max(n)
        FROM ({base}) GROUP BY category, op, vpp_stage, name HAVING max(rel) > 0
        ORDER BY rel DESC, category, op, name LIMIT {limits.spread_rows}""").fetchall()
    series = con.execute(f"""
        SELECT category, (step - {first}) // {width} AS b, max(rel) FROM ({base}) GROUP BY ALL ORDER BY category, b
        """).fetchall()
    by_category: dict[str, list[list[float]]] = {}
    for category, b, rel in series:
        by_category.setdefault(category, []).append([first + b * width, rel])
    return {
        "compared_values": compared[0],
        "compared_tensors": compared[1],
        "max_ranks": compared[2],
        "categories": list(REPLICATED_CATEGORIES),
        "top": [
            {
                "category": c,
                "op": op,
                "vpp_stage": vpp,
                "name": name,
                "rel": rel,
                "step": step,
                "spread": spread,
                "min": lo,
                "max": hi,
                "min_rank": lo_rank,
                "max_rank": hi_rank,
                "ranks": n,
            }
            for c, op, vpp, name, rel, step, spread, lo, hi, lo_rank, hi_rank, n in top
        ],
        "series": by_category,
    }


def cost(con: DuckDBPyConnection, limits: Limits) -> dict[str, Any]:
    """The monitor's own cost per rank (summary.json), with the spread over ranks."""
    rows = con.execute(
        "SELECT rank, step_ms, monitor_ms_per_step, monitor_cost_pct, writer_cpu_ms_per_step, "
        "steps_recorded, alerts FROM summaries ORDER BY rank"
    ).fetchall()
    if not rows:
        return {"ranks": 0}
    keys = ("step_ms", "monitor_ms_per_step", "monitor_cost_pct", "writer_cpu_ms_per_step")
    stats = {}
    for i, key in enumerate(keys, 1):
        values = sorted(r[i] for r in rows if r[i] is not None)
        if values:
            stats[key] = {
                "min": values[0],
                "median": statistics.median(values),
                "p90": values[min(len(values) - 1, int(0.9 * len(values)))],
                "max": values[-1],
            }
    group = max(1, math.ceil(len(rows) / limits.cost_bars))
    bars = []
    for i in range(0, len(rows), group):
        chunk = [r for r in rows[i : i + group] if r[3] is not None]
        if chunk:
            worst = max(chunk, key=lambda r: r[3])
            bars.append([rows[i][0], rows[min(i + group, len(rows)) - 1][0], worst[3], worst[0]])
    top = sorted((r for r in rows if r[3] is not None), key=lambda r: -r[3])[:10]
    return {
        "ranks": len(rows),
        "stats": stats,
        "bars": bars,
        "ranks_per_bar": group,
        "top": [dict(zip(("rank",) + keys + ("steps_recorded", "alerts"), r)) for r in top],
        "steps_recorded": sum(r[5] or 0 for r in rows),
        "alerts": sum(r[6] or 0 for r in rows),
    }


def report_data(con: DuckDBPyConnection, limits: Limits | None = None, tmp_dir: str | None = None) -> dict[str, Any]:
    """Everything the page shows, as one JSON-ready dict."""
    from .value_fold import fold_values

    limits = limits or Limits()
    folded = fold_values(con, OWN_CHARTS, limits)  # writes per_step
    maps, steps = heatmaps(con, limits, folded, tmp_dir)
    for heatmap in maps:  # the row charts, made as each category was folded
        heatmap["series"] = folded.charts[heatmap["category"]][heatmap["op"]]
    series = folded.series.info()
    return {
        "overview": overview(con),
        "steps": steps,
        "series": series,
        "limits": limits.__dict__,
        "heatmaps": maps,
        "loss": loss_chart(con, limits),
        "agreement": agreement_chart(con, limits),
        "rank_outliers": folded.outliers.result(limits),
        "movers": movers(con, limits),
        "spread": rank_spread(con, limits, steps["first_step"], steps["step_width"]),
        "anomalies": anomalies(con, limits),
        "first_nonfinite": first_nonfinite(con)[:50],
        "cost": cost(con, limits),
        "actions": action_spans(con),
    }

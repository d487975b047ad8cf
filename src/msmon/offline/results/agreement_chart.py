"""The report's gradient agreement: each rank's signed cos on a linear scale and its norm_ratio,
over steps, and the rank that dominates the reduced gradient (anomaly/agreement.py reads cos and
norm_ratio together).

The rows are the `grad_agreement` category (`"grad_agreement": true`: `cos` and `norm_ratio`, one
row per rank and step). A grid per op: a row per rank, a column per step. Up to Limits.max_rows
ranks; above, the ranks whose norm_ratio left the others' most. Up to Limits.max_steps columns;
above, neighbouring steps are averaged (non-finite where any was). The verdict reads every step:
one SQL pass gives, per step, the rank with the largest norm_ratio, its cos, and the ranks'
median, MAD and sum of norm_ratio and the sum of their cos.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ...anomaly.agreement import StepAgreement
from ...anomaly.rank_spread import DEFAULT_K
from .limits import Limits
from .loss_chart import number
from .sql import one_row

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

AGREEMENT_CATEGORY = "grad_agreement"
OPS = ("cos", "norm_ratio")
_PAIRS = f"""
    WITH q AS (SELECT rank, step, value FROM metrics WHERE category = '{AGREEMENT_CATEGORY}' AND op = 'norm_ratio'
               AND isfinite(value)),
         c AS (SELECT rank, step, value FROM metrics WHERE category = '{AGREEMENT_CATEGORY}' AND op = 'cos'
               AND isfinite(value)),
         j AS (SELECT rank, step, q.value AS q, c.value AS c FROM q JOIN c USING (rank, step))"""


def step_agreements(con: DuckDBPyConnection) -> list[StepAgreement]:
    """Every step's agreement across the ranks with a finite cos and norm_ratio there."""
    rows = con.execute(f"""{_PAIRS}
        SELECT step, count(*), arg_max(rank, q), arg_max(c, q), max(q), median(q), mad(q), sum(q), sum(c)
        FROM j GROUP BY step HAVING count(*) >= 2 ORDER BY step""").fetchall()
    return [StepAgreement(int(r[0]), int(r[1]), int(r[2]), *(float(v) for v in r[3:])) for r in rows]


def agreement_chart(con: DuckDBPyConnection, limits: Limits) -> dict[str, Any]:
    """The grids (row-major lists, None where not recorded, the name of a non-finite value) and
    the verdict, or {"steps": 0} when no agreement was recorded."""
    where = f"category = '{AGREEMENT_CATEGORY}'"
    first, last, steps, ranks = one_row(
        con.execute(
            f"SELECT min(step), max(step), count(DISTINCT step), count(DISTINCT rank) FROM metrics WHERE {where}"
        )
    )
    if not steps:
        return {"steps": 0}
    width = max(1, math.ceil((last - first + 1) / limits.max_steps))
    columns = (last - first) // width + 1
    per_step = step_agreements(con)
    shown = _ranks_shown(con, limits.max_rows)
    index = {r: i for i, r in enumerate(shown)}
    grids: dict[str, list[list[Any]]] = {op: [[None] * columns for _ in shown] for op in OPS}
    for op, rank, b, value, bad in con.execute(f"""
        SELECT op, rank, (step - {first}) // {width} AS b, avg(value) FILTER (WHERE isfinite(value)),
          CASE WHEN bool_or(isnan(value)) THEN 'nan' WHEN bool_or(isinf(value)) THEN 'inf' END
        FROM metrics WHERE {where} AND op IN {OPS} GROUP BY ALL""").fetchall():
        if rank in index:
            grids[op][index[rank]][b] = bad if bad else number(value)
    dominant = [a for a in per_step if a.dominates(DEFAULT_K)]
    verdict = None
    if dominant:
        a = dominant[0]
        verdict = {
            "step": a.step,
            "rank": a.rank,
            "steps": len(dominant),
            "ranks": sorted({d.rank for d in dominant}),
            "text": f"From step {a.step}, {a.describe()}.",
            "cos": a.cos,
            "norm_ratio": a.ratio,
            "cos_with_others": number(a.cos_with_others()),
            "others_cos": number(a.others_cos()),
            "agreement_without": number(a.agreement_without()),
        }
    return {
        "steps": steps,
        "first_step": first,
        "last_step": last,
        "step_width": width,
        "columns": columns,
        "ranks": ranks,
        "rows": shown,
        "cos": grids["cos"],
        "norm_ratio": grids["norm_ratio"],
        "threshold": DEFAULT_K,
        "dominant": verdict,
    }


def _ranks_shown(con: DuckDBPyConnection, most: int) -> list[int]:
    """Every rank, or the `most` whose norm_ratio left the step's median most (then in rank order)."""
    rows = con.execute(f"""{_PAIRS},
        m AS (SELECT step, median(q) AS med FROM j GROUP BY step)
        SELECT rank, max(q / nullif(med, 0)) AS away FROM j JOIN m USING (step) GROUP BY rank""").fetchall()
    every = con.execute(f"SELECT DISTINCT rank FROM metrics WHERE category = '{AGREEMENT_CATEGORY}'").fetchall()
    ranks = sorted(r[0] for r in every)
    if len(ranks) <= most:
        return ranks
    away = {r: (v if v is not None else 0.0) for r, v in rows}
    return sorted(sorted(ranks, key=lambda r: (-away.get(r, 0.0), r))[:most])

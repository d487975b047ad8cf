"""The report's per-rank outliers: rank-local tensors, where each rank has its own value.

Activations and unreduced gradients differ from rank to rank by design (each rank has its own
batch), so the replicated tensors' spread says nothing about them. What does: at each step and
micro-step, how far one rank's norm lies from the ranks' median, in robust standard deviations
(robust.py: median and MAD). Per tensor, the rank and step where that is largest; the tensors
where it is largest first. Only finite norms count (a non-finite one is the anomaly section's),
and only steps where at least three ranks wrote the tensor (with two, both are as far from
their median).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...records.rows import REPLICATED_CATEGORIES, TENSOR_CATEGORIES
from .limits import Limits
from .robust import MAD_FLOOR, MAD_SCALE, SQL_Z

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

RANK_LOCAL_CATEGORIES = tuple(c for c in TENSOR_CATEGORIES if c not in REPLICATED_CATEGORIES)
OUTLIER_OP = "norm"
MIN_RANKS = 3


def rank_outliers(con: DuckDBPyConnection, limits: Limits) -> dict[str, Any]:
    """The top Limits.rank_outliers tensors by their largest robust z over ranks."""
    categories = ", ".join(f"'{c}'" for c in RANK_LOCAL_CATEGORIES)
    key = "category, vpp_stage, name, step, mstep"
    rows = con.execute(f"""
        WITH x AS (
          SELECT category, vpp_stage, name, step, coalesce(micro_step, -1) AS mstep, rank, value FROM metrics
          WHERE op = '{OUTLIER_OP}' AND category IN ({categories}) AND isfinite(value)),
        m AS (SELECT {key}, median(value) AS med, count(*) AS n FROM x GROUP BY ALL HAVING count(*) >= {MIN_RANKS}),
        d AS (SELECT x.*, m.med, m.n, abs(x.value - m.med) AS dev FROM x JOIN m USING ({key})),
        a AS (SELECT {key}, median(dev) AS mad FROM d GROUP BY ALL),
        z AS (SELECT d.*, a.mad, {SQL_Z} AS z FROM d JOIN a USING ({key})),
        best AS (
          SELECT category, vpp_stage, name, max(z) AS z, arg_max(rank, z) AS rank, arg_max(step, z) AS step,
            arg_max(mstep, z) AS mstep, arg_max(value, z) AS value, arg_max(med, z) AS med,
            arg_max(mad, z) AS mad, arg_max(n, z) AS n
          FROM z GROUP BY ALL)
        SELECT category, vpp_stage, name, rank, step, mstep, value, med, mad, n, z FROM best
        ORDER BY z DESC, category, name LIMIT {limits.rank_outliers}""").fetchall()
    compared = con.execute(f"""
        SELECT count(DISTINCT (category, vpp_stage, name)), max(n) FROM (
          SELECT category, vpp_stage, name, count(*) AS n FROM metrics
          WHERE op = '{OUTLIER_OP}' AND category IN ({categories}) AND isfinite(value)
          GROUP BY category, vpp_stage, name, step, micro_step)""").fetchone()
    return {
        "categories": list(RANK_LOCAL_CATEGORIES),
        "op": OUTLIER_OP,
        "min_ranks": MIN_RANKS,
        "mad_scale": MAD_SCALE,
        "mad_floor": MAD_FLOOR,
        "tensors": compared[0] if compared else 0,
        "max_ranks": (compared[1] or 0) if compared else 0,
        "top": [
            {
                "category": category,
                "vpp_stage": vpp,
                "name": name,
                "rank": rank,
                "step": step,
                "micro_step": None if mstep < 0 else mstep,
                "value": value,
                "median": med,
                "mad": mad,
                "ranks": n,
                "z": z,
            }
            for category, vpp, name, rank, step, mstep, value, med, mad, n, z in rows
        ],
    }

"""`per_step`, the report's one row per tensor, op, step and micro-step over ranks, folded from
the value windows (value_window.py) in numpy and written as a temp table.

A row holds the largest finite |value| over ranks and the rank that holds it, whether any rank
had a non-finite value, the count of values, the lowest rank with a non-finite one and which
non-finite value it was (`nf`: NaN if any was NaN, else inf, else -inf), and, for the
replicated categories (the only ones the rank spread reads), the finite min and max with the
ranks that hold them (NULL elsewhere). Ties go to the lower rank. The reductions run over the
rank axis, row after row of ranks, so each is one pass over the window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...records.rows import REPLICATED_CATEGORIES
from .value_plan import ValuePlan
from .value_window import Window

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

NF_NONE, NF_NEG_INF, NF_POS_INF, NF_NAN = 0, 1, 2, 3
_COLUMNS = (
    "category", "op", "tensor", "step", "micro", "v", "v_rank", "bad", "n", "lo", "hi", "lo_rank", "hi_rank",
    "bad_rank", "nf",
)  # fmt: skip
PER_STEP_COLUMNS = [
    ("category", "VARCHAR"),
    ("op", "VARCHAR"),
    ("vpp_stage", "INTEGER"),
    ("name", "VARCHAR"),
    ("step", "BIGINT"),
    ("micro_step", "INTEGER"),
    ("v", "DOUBLE"),
    ("bad", "BOOLEAN"),
    ("n", "BIGINT"),
    ("lo", "DOUBLE"),
    ("hi", "DOUBLE"),
    ("lo_rank", "INTEGER"),
    ("hi_rank", "INTEGER"),
    ("v_rank", "INTEGER"),
    ("bad_rank", "INTEGER"),
    ("nf", "DOUBLE"),
]


def first_extreme(rows: np.ndarray, larger: bool, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The largest (or smallest) of each column of `rows` and the first row that holds it, one
    row at a time (numpy's argmax over the first axis copies the array); only where `counts`
    (a boolean array like `rows`) is true when given, NaN where nothing counts."""
    if counts is None:
        best = rows[0].copy()
        where = np.zeros(best.shape, dtype=np.int64)
        start = 1
    else:
        best = np.full(rows.shape[1:], -np.inf if larger else np.inf)
        where = np.full(best.shape, -1, dtype=np.int64)
        start = 0
    better = np.greater if larger else np.less
    for i in range(start, rows.shape[0]):
        wins = better(rows[i], best)
        if counts is not None:
            wins &= counts[i]
        np.copyto(best, rows[i], where=wins)
        np.copyto(where, i, where=wins)
    if counts is not None:
        best[where < 0] = np.nan
    return best, where


class PerStepRows:
    """The per_step rows of every window, kept as arrays until written."""

    def __init__(self, plan: ValuePlan) -> None:
        self.plan = plan
        self.parts: list[dict[str, np.ndarray]] = []

    def add(self, index: int, window: Window) -> None:
        """The rows of the window of category `index`."""
        finite, value, magnitude = window.flat(window.finite), window.flat(window.value), window.flat(window.magnitude)
        if window.dense:
            n = np.full(window.cells, finite.shape[0], dtype=np.int64)
        else:
            n = np.count_nonzero(window.flat(window.present), axis=0)
        cells = np.flatnonzero(n)
        if not cells.size:
            return
        ranks = window.slot_ranks
        v, v_slot = first_extreme(magnitude, larger=True)
        nonfinite = None if window.nonfinite is None else window.flat(window.nonfinite)
        bad_any = np.zeros(window.cells, dtype=bool) if nonfinite is None else np.asarray(nonfinite.any(axis=0))
        part = {
            "category": np.full(cells.size, index, dtype=np.int64),
            "v": np.where(v[cells] >= 0, v[cells], np.nan),
            "v_rank": np.where(v[cells] >= 0, ranks[v_slot[cells]], -1),
            "bad": bad_any[cells],
            "n": n[cells].astype(np.int64),
        }
        shape = window.value.shape[1:]
        o, t, s, m = np.unravel_index(cells, shape)
        part.update(op=o, tensor=t, step=window.first + s, micro=m + self.plan.categories[index].first_micro)
        self._extremes(part, window, value, finite, cells)
        self._nonfinite(part, window, value, nonfinite, cells, bad_any)
        self.parts.append(part)

    def _extremes(
        self,
        part: dict[str, np.ndarray],
        window: Window,
        value: np.ndarray,
        finite: np.ndarray,
        cells: np.ndarray,
    ) -> None:
        """lo, hi and their ranks, for the replicated categories."""
        nulls = np.full(cells.size, np.nan)
        part.update(lo=nulls, hi=nulls, lo_rank=np.full(cells.size, -1), hi_rank=np.full(cells.size, -1))
        if window.category not in REPLICATED_CATEGORIES:
            return
        gaps = not window.dense or window.nonfinite is not None  # a value that does not count
        for key, larger in (("hi", True), ("lo", False)):
            best, slot = first_extreme(value, larger, finite if gaps else None)
            has = np.isfinite(best[cells])
            part[key] = np.where(has, best[cells], np.nan)
            part[f"{key}_rank"] = np.where(has, window.slot_ranks[slot[cells]], -1)

    def _nonfinite(
        self,
        part: dict[str, np.ndarray],
        window: Window,
        value: np.ndarray,
        bad: np.ndarray | None,
        cells: np.ndarray,
        bad_any: np.ndarray,
    ) -> None:
        """bad_rank and nf, where a value was non-finite."""
        part["bad_rank"] = np.full(cells.size, -1)
        part["nf"] = np.full(cells.size, NF_NONE, dtype=np.int8)
        hit = np.flatnonzero(bad_any[cells])
        if bad is None or not hit.size:
            return
        columns = cells[hit]
        flags, values = bad[:, columns], value[:, columns]
        ranks = np.where(flags, window.slot_ranks[:, None], np.iinfo(np.int64).max)
        part["bad_rank"][hit] = ranks.min(axis=0)
        nan = (flags & np.isnan(values)).any(axis=0)
        pos = (flags & (values == np.inf)).any(axis=0)
        part["nf"][hit] = np.where(nan, NF_NAN, np.where(pos, NF_POS_INF, NF_NEG_INF))

    def write(self, con: DuckDBPyConnection) -> None:
        """The temp table per_step."""
        con.execute(f"CREATE OR REPLACE TEMP TABLE per_step ({', '.join(f'{n} {k}' for n, k in PER_STEP_COLUMNS)})")
        if not self.parts:
            return
        plan = self.plan
        rows = {k: np.concatenate([p[k] for p in self.parts]) for k in _COLUMNS}
        tensors = [
            (i, t, c.name, vpp, name) for i, c in enumerate(plan.categories) for t, (vpp, name) in enumerate(c.tensors)
        ]
        names = {
            "category": np.asarray([r[0] for r in tensors], dtype=np.int64),
            "tensor": np.asarray([r[1] for r in tensors], dtype=np.int64),
            "category_name": np.asarray([r[2] for r in tensors], dtype=object),
            "vpp_stage": np.asarray([r[3] for r in tensors], dtype=np.int64),
            "name": np.asarray([r[4] for r in tensors], dtype=object),
        }
        ops = {"op": np.arange(len(plan.ops), dtype=np.int64), "op_name": np.asarray(plan.ops, dtype=object)}
        con.register("report_fold_rows", rows)
        con.register("report_fold_tensors", names)
        con.register("report_fold_ops", ops)
        try:
            con.execute(f"""
                INSERT INTO per_step
                SELECT t.category_name, o.op_name, t.vpp_stage, t.name, r.step,
                  CASE WHEN r.micro >= 0 THEN r.micro END,
                  CASE WHEN NOT isnan(r.v) THEN r.v END, r.bad, r.n,
                  CASE WHEN NOT isnan(r.lo) THEN r.lo END, CASE WHEN NOT isnan(r.hi) THEN r.hi END,
                  CASE WHEN r.lo_rank >= 0 THEN r.lo_rank END, CASE WHEN r.hi_rank >= 0 THEN r.hi_rank END,
                  CASE WHEN r.v_rank >= 0 THEN r.v_rank END, CASE WHEN r.bad_rank >= 0 THEN r.bad_rank END,
                  CASE r.nf WHEN {NF_NAN} THEN 'nan'::DOUBLE WHEN {NF_POS_INF} THEN 'inf'::DOUBLE
                    WHEN {NF_NEG_INF} THEN '-inf'::DOUBLE END
                FROM report_fold_rows r JOIN report_fold_tensors t USING (category, tensor)
                  JOIN report_fold_ops o USING (op)""")
        finally:
            for view in ("report_fold_rows", "report_fold_tensors", "report_fold_ops"):
                con.unregister(view)

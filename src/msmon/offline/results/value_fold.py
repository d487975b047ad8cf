"""One read of the run's values for the whole report, folded in numpy.

Each category is read a window of steps at a time (value_plan.py: DuckDB places each value in
the window's array as it reads it) and the window is folded into what the page needs from
every value: `per_step` (per_step_fold.py), the row charts' per-rank points (rank_points.py)
and the per-rank outliers (rank_outliers.py). Everything else the page shows is read from
per_step or from small tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .connection import DatabaseError
from .huge_pages import small_pages
from .limits import Limits
from .per_step_fold import PerStepRows
from .rank_outliers import OutlierFold
from .rank_points import PointsFold
from .value_plan import ValuePlan, make_plan, window_query
from .value_window import Unplaced, Workspace, place

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection


@dataclass
class StepColumns:
    """The heatmaps' columns: `width` steps each from `first`."""

    first: int = 0
    width: int = 1
    columns: int = 0

    @classmethod
    def of(cls, first: int | None, last: int | None, limits: Limits) -> StepColumns:
        if first is None or last is None:
            return cls()
        span = last - first + 1
        width = max(1, math.ceil(span / limits.max_steps))
        return cls(first, width, math.ceil(span / width))


@dataclass
class Folded:
    """What the fold leaves for the page besides the per_step table."""

    plan: ValuePlan
    steps: StepColumns
    outliers: OutlierFold
    tensors: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # per category, in row order
    per_row: dict[str, int] = field(default_factory=dict)  # tensors per heatmap row
    points: dict[str, PointsFold] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)  # the ranks with a value
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # theirs in the plan


def fold_values(con: DuckDBPyConnection, excluded: str, limits: Limits) -> Folded:
    """Fold every value outside the categories `excluded` (a SQL list); writes per_step."""
    with small_pages():
        try:
            return _fold(con, make_plan(con, excluded), limits)
        except Unplaced:  # a rank, tensor or op the catalog does not list: take them from the values
            pass
        try:
            return _fold(con, make_plan(con, excluded, discover=True), limits)
        except Unplaced as exc:
            raise DatabaseError(
                f"the values of {exc} changed while msmon report read them (a job still writing?): run it again"
            ) from None


def _fold(con: DuckDBPyConnection, plan: ValuePlan, limits: Limits) -> Folded:
    folded = Folded(plan, StepColumns.of(plan.first_step, plan.last_step, limits), OutlierFold(plan.ops))
    per_step = PerStepRows(plan)
    space = Workspace()
    ranks, ops = len(plan.ranks), len(plan.ops)
    seen = np.zeros(ranks, dtype=bool)
    for index, category in enumerate(plan.categories):
        per_row = max(1, math.ceil(len(category.tensors) / limits.max_rows))
        steps = folded.steps
        points = PointsFold(plan.ops, ranks, len(category.tensors), per_row, steps.first, steps.width, steps.columns)
        for first, last in category.windows(ranks, ops):
            cursor = con.cursor()  # closed at once: DuckDB's copy of the rows goes with it
            try:
                got = cursor.execute(window_query(plan, category, first, last)).fetchnumpy()
            finally:
                cursor.close()
            at, value = np.asarray(got.pop("at")), np.asarray(got.pop("value"), dtype=np.float64)
            shape = (ops, len(category.tensors), last - first + 1, category.micro)
            window = place(space, category.name, first, plan.ranks, shape, at, value)
            del at, value
            seen |= True if window.dense else window.present.reshape(window.layers, ranks, -1).any(axis=(0, 2))
            per_step.add(index, window)
            points.add(window)
            folded.outliers.add(window, category.tensors, category.first_micro)
        folded.tensors[category.name] = category.tensors
        folded.per_row[category.name] = per_row
        folded.points[category.name] = points
    per_step.write(con)
    folded.slots = np.flatnonzero(seen)
    folded.ranks = [plan.ranks[i] for i in folded.slots]
    return folded

"""One read of the run's values for the whole report, folded in numpy.

The values arrive as windows, a category's dense array over some steps: from the Parquet files
themselves where they hold every value (parquet_values.py: pyarrow, each file once per group of
steps), else through DuckDB, a category and a window of steps at a time (value_plan.py: DuckDB
places each value in the window's array as it reads it). Each window is folded into what the
page needs from every value: `per_step` (per_step_fold.py), the row charts' per-rank points
(rank_points.py) and the per-rank outliers (rank_outliers.py). A category's row charts are made,
on a second thread, as soon as its last window is folded (row_series.py, laid out from the plan),
and its points let go with them. Everything else the page shows is read from per_step or from
small tables."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .connection import DatabaseError
from .huge_pages import small_pages
from .limits import Limits
from .parquet_values import ParquetWindows, Repeated, parquet_files
from .per_step_fold import PerStepRows
from .rank_outliers import OutlierFold
from .rank_points import PointsFold
from .row_series import SeriesLayout, category_series
from .value_plan import ValuePlan, make_plan, window_query
from .value_window import Unplaced, Window, Workspace, place

log = logging.getLogger(__name__)

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
    series: SeriesLayout
    per_row: dict[str, int] = field(default_factory=dict)  # tensors per heatmap row
    charts: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # category -> op -> row charts
    points: dict[str, PointsFold] = field(default_factory=dict)  # only with keep_points

    @property
    def tensors(self) -> dict[str, list[tuple[int, str]]]:
        """Each category's tensors, in row order."""
        return {c.name: c.tensors for c in self.plan.categories}


def fold_values(con: DuckDBPyConnection, excluded: str, limits: Limits, keep_points: bool = False) -> Folded:
    """Fold every value outside the categories `excluded` (a SQL list); writes per_step. A
    category's per-rank points are let go once its row charts are made (`keep_points`: kept)."""
    files = parquet_files(con, excluded)
    reader = ParquetWindows(files) if files else None
    with small_pages():
        for discover in (False, True):
            spans = reader.category_spans() if reader is not None else None
            plan = make_plan(con, excluded, discover=discover, spans=spans)
            try:
                if reader is not None:
                    try:
                        return _fold(con, plan, reader.windows(plan, Workspace()), limits, keep_points)
                    except Repeated:  # a value written twice at one place: DuckDB's read keeps both
                        reader = None
                    except (OSError, ValueError, KeyError) as exc:  # a file pyarrow cannot read as written
                        log.info("msmon report: the Parquet files read through DuckDB instead (%s)", exc)
                        reader = None
                return _fold(con, plan, _duckdb_windows(con, plan, Workspace()), limits, keep_points)
            except Unplaced as exc:  # a rank, tensor or op the catalog does not list: take them from the values
                unplaced = exc
    raise DatabaseError(
        f"the values of {unplaced} changed while msmon report read them (a job still writing?): run it again"
    ) from None


def _duckdb_windows(con: DuckDBPyConnection, plan: ValuePlan, space: Workspace) -> Iterator[tuple[int, Window, bool]]:
    """(category index, window, whether it is the category's last), read through the `metrics`
    view a category and a window of steps at a time."""
    ranks, ops = len(plan.ranks), len(plan.ops)
    for index, category in enumerate(plan.categories):
        windows = category.windows(ranks, ops)
        for n, (first, last) in enumerate(windows):
            cursor = con.cursor()  # closed at once: DuckDB's copy of the rows goes with it
            try:
                got = cursor.execute(window_query(plan, category, first, last)).fetchnumpy()
            finally:
                cursor.close()
            at, value = np.asarray(got.pop("at")), np.asarray(got.pop("value"), dtype=np.float64)
            shape = (ops, len(category.tensors), last - first + 1, category.micro)
            window = place(space, category.name, first, plan.ranks, shape, at, value)
            del at, value
            yield index, window, n == len(windows) - 1


def _fold(
    con: DuckDBPyConnection,
    plan: ValuePlan,
    windows: Iterator[tuple[int, Window, bool]],
    limits: Limits,
    keep_points: bool,
) -> Folded:
    steps = StepColumns.of(plan.first_step, plan.last_step, limits)
    per_row = {c.name: max(1, math.ceil(len(c.tensors) / limits.max_rows)) for c in plan.categories}
    charts_rows = sum(math.ceil(len(c.tensors) / per_row[c.name]) * len(plan.ops) for c in plan.categories)
    layout = SeriesLayout.of(limits, plan.ranks, charts_rows, steps.width, steps.columns)
    folded = Folded(plan, steps, OutlierFold(plan.ops), layout, per_row=per_row)
    per_step = PerStepRows(plan)
    folding: dict[int, PointsFold] = {}  # categories with windows still to come
    charts: dict[str, Future[dict[str, Any]]] = {}
    with ThreadPoolExecutor(1) as drawing:  # a category's charts made while the next is folded
        for index, window, last in windows:
            category = plan.categories[index]
            points = folding.get(index)
            if points is None:
                points = folding[index] = PointsFold(
                    plan.ops,
                    len(plan.ranks),
                    len(category.tensors),
                    per_row[category.name],
                    steps.first,
                    steps.width,
                    steps.columns,
                )
            per_step.add(index, window)
            points.add(window)
            folded.outliers.add(window, category.tensors, category.first_micro)
            del window
            if not last:
                continue
            del folding[index]
            if steps.columns:
                present = [op for op, seen in zip(plan.ops, points.seen_ops) if seen]
                charts[category.name] = drawing.submit(category_series, limits, layout, points, present)
            if keep_points:
                folded.points[category.name] = points
            del points
        folded.charts = {name: made.result() for name, made in charts.items()}
    per_step.write(con)
    return folded

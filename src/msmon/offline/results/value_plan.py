"""What the report reads of the values, and where each value goes in a dense array.

The report folds every value of the run once, in numpy (value_fold.py): a category's values, a
window of steps at a time, are placed in an array of (ranks, ops, tensors, steps, micro-steps),
ranks first, by an index DuckDB computes as it reads them (`at`). A hash aggregation in DuckDB,
one group per (tensor, op, step) or per (rank, chart point), cost most of a report of 512 ranks:
placing the values and reducing over the rank axis costs a small part of that.

The axes come from what the database already holds, not from a scan of the values: the ranks
from `files`, the tensors and their order from `tensors`, the ops from stats/ops.py; a scan
gives only each category's steps and micro-steps. A value of a rank, tensor or op they do not
list (a Parquet file a running job closed after `msmon db`) has no place (`at` -1): the plan is
then made again from the values themselves (`discover`), and the fold starts over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .bulk import _quoted
from .schema import OPS

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

WINDOW_CELLS = 1 << 25  # cells of one window's array: 256 MiB of float64 (and as many booleans)


@dataclass
class CategoryPlan:
    """One category's axes: tensors in the order the monitor wrote them, its steps and micro-steps
    (NULL as -1)."""

    name: str
    tensors: list[tuple[int, str]]
    first_step: int
    last_step: int
    first_micro: int
    last_micro: int

    @property
    def micro(self) -> int:
        return self.last_micro - self.first_micro + 1

    def cells_per_step(self, ranks: int, ops: int) -> int:
        return ranks * ops * len(self.tensors) * self.micro

    def windows(self, ranks: int, ops: int) -> list[tuple[int, int]]:
        """(first step, last step) of each window: as many steps as WINDOW_CELLS holds, one at least."""
        span = max(1, WINDOW_CELLS // max(1, self.cells_per_step(ranks, ops)))
        return [(s, min(s + span - 1, self.last_step)) for s in range(self.first_step, self.last_step + 1, span)]


@dataclass
class ValuePlan:
    """The axes of every category the report folds (all but those drawn by charts of their own)."""

    ranks: list[int]
    ops: list[str]
    categories: list[CategoryPlan] = field(default_factory=list)

    @property
    def first_step(self) -> int | None:
        return min((c.first_step for c in self.categories), default=None)

    @property
    def last_step(self) -> int | None:
        return max((c.last_step for c in self.categories), default=None)

    def consecutive_ranks(self) -> bool:
        return bool(self.ranks) and self.ranks == list(range(self.ranks[0], self.ranks[0] + len(self.ranks)))


def make_plan(
    con: DuckDBPyConnection,
    excluded: str,
    discover: bool = False,
    spans: list[tuple[str, int, int, int, int]] | None = None,
) -> ValuePlan:
    """The plan of the values outside the categories `excluded` (a SQL list); `discover`: the
    ranks, tensors and ops from the values themselves rather than from the catalog; `spans`:
    each category's steps and micro-steps, known without a scan (parquet_values.py: the files'
    footers), else scanned."""
    where = f"category NOT IN ({excluded})"
    if spans is None or discover:
        spans = con.execute(
            f"SELECT category, min(step), max(step), min(coalesce(micro_step, -1)), max(coalesce(micro_step, -1)) "
            f"FROM metrics WHERE {where} GROUP BY category ORDER BY category"
        ).fetchall()
    else:
        left_out = {r[0] for r in con.execute(f"SELECT unnest([{excluded}])").fetchall()}
        spans = [s for s in spans if s[0] not in left_out]
    if discover:
        ranks = [r[0] for r in con.execute(f"SELECT DISTINCT rank FROM metrics WHERE {where} ORDER BY rank").fetchall()]
        found = {r[0] for r in con.execute(f"SELECT DISTINCT op FROM metrics WHERE {where}").fetchall()}
        listed = con.execute(
            f"SELECT m.category, m.vpp_stage, m.name FROM (SELECT DISTINCT category, vpp_stage, name FROM metrics "
            f"WHERE {where}) m LEFT JOIN tensors t USING (category, vpp_stage, name) "
            "ORDER BY m.category, t.position NULLS LAST, m.vpp_stage, m.name"
        ).fetchall()
    else:
        ranks = [
            r[0]
            for r in con.execute(
                "SELECT DISTINCT rank FROM files WHERE kind IN ('csv', 'tensorboard', 'parquet') ORDER BY rank"
            ).fetchall()
        ]
        found = {
            op for (ops,) in con.execute("SELECT DISTINCT ops FROM configs").fetchall() for op in (ops or "").split(",")
        }
        found.discard("")
        listed = con.execute(
            f"SELECT category, vpp_stage, name FROM tensors WHERE {where} "
            "ORDER BY category, position NULLS LAST, vpp_stage, name"
        ).fetchall()
    tensors: dict[str, list[tuple[int, str]]] = {}
    for category, vpp, name in listed:
        tensors.setdefault(category, []).append((vpp, name))
    # the ops the monitors were configured with (the catalog's configs), in OPS order; all of OPS without configs
    ops = [op for op in OPS if op in found or not found] + sorted(found - set(OPS))
    plan = ValuePlan(ranks, ops)
    for category, first, last, first_micro, last_micro in spans:
        plan.categories.append(CategoryPlan(category, tensors.get(category, []), first, last, first_micro, last_micro))
    return plan


def window_query(plan: ValuePlan, category: CategoryPlan, first: int, last: int) -> str:
    """(at, value) of the category's values at steps first..last: `at` the value's place in the
    window's array (ranks, ops, tensors, steps, micro-steps), -1 where the plan has none."""
    tensors, steps, micro = len(category.tensors), last - first + 1, category.micro
    joins = []
    if plan.consecutive_ranks():  # a rank outside them has its `at` outside the array: place() says so
        rank = f"m.rank - {plan.ranks[0]}"
    else:
        rank = "k.slot"
        listed = ", ".join(f"({r}, {i})" for i, r in enumerate(plan.ranks))
        joins.append(f"LEFT JOIN (VALUES {listed}) k(rank, slot) ON k.rank = m.rank")
    names = [name for _, name in category.tensors]
    stages = {vpp for vpp, _ in category.tensors}
    if not names:  # no tensor listed: every value is unplaced
        tensor = "NULL"
    elif len(set(names)) == len(names) and len(stages) == 1:  # a name says which tensor: its code in an ENUM
        tensor = f"CASE WHEN m.vpp_stage = {stages.pop()} THEN enum_code(TRY_CAST(m.name AS {_enum(names)})) END"
    else:
        tensor = "t.slot"
        listed = ", ".join(f"({vpp}, '{_quoted(name)}', {i})" for i, (vpp, name) in enumerate(category.tensors))
        joins.append(
            f"LEFT JOIN (VALUES {listed}) t(vpp_stage, name, slot) ON t.vpp_stage = m.vpp_stage AND t.name = m.name"
        )
    cells = len(plan.ranks) * len(plan.ops) * tensors * steps * micro
    kind = "INTEGER" if cells < 2**31 else "BIGINT"
    micro_step, m0, m1 = "coalesce(m.micro_step, -1)", category.first_micro, category.last_micro
    # steps and micro-steps outside the plan's (values a running job wrote after it was made) are not read
    return f"""
        SELECT coalesce(((((({rank}) * {len(plan.ops)} + enum_code(TRY_CAST(m.op AS {_enum(plan.ops)})))
            * {tensors} + ({tensor})) * {steps} + (m.step - {first})) * {micro} + ({micro_step} - {m0}))::{kind}, -1)
            AS at, m.value
        FROM metrics m {" ".join(joins)}
        WHERE m.category = '{_quoted(category.name)}' AND m.step BETWEEN {first} AND {last}
          AND {micro_step} BETWEEN {m0} AND {m1} AND m.value IS NOT NULL"""


def _enum(values: list[str]) -> str:
    """An ENUM type of `values`: a string's code is its place in the list (NULL, cast with
    TRY_CAST, for any other string). Casting a column to it costs less than a CASE or a join."""
    return "ENUM(" + ", ".join(f"'{_quoted(v)}'" for v in values) + ")"

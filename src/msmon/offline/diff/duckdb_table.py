"""`--db FILE`: the comparison in DuckDB, beside (never inside) the databases `msmon db` writes.

    diff        one row per value that differs between A and B: step, micro_step, category,
                vpp_stage, name, op, statistic, rank, a_rank, a, b, relative_difference,
                tolerance, over, counted (values that are the same are not written)
    diff_front  per step and category: rows compared and over, tensors over, the largest difference
    diff_info   key, value: both sides, the tolerance, the verdict, first_divergence (JSON)

A file that exists is replaced only when a comparison wrote it (it has `diff_info`).
"""

from __future__ import annotations

import json
import os

from ..results.bulk import insert_rows
from ..results.connection import DatabaseError, connect
from .errors import DiffInputError
from .json_report import to_json
from .outcome import Outcome
from .table import NO_MICRO

DIFF_COLUMNS = [
    ("step", "BIGINT"),
    ("micro_step", "INTEGER"),
    ("category", "VARCHAR"),
    ("vpp_stage", "INTEGER"),
    ("name", "VARCHAR"),
    ("op", "VARCHAR"),
    ("statistic", "VARCHAR"),
    ("rank", "INTEGER"),
    ("a_rank", "INTEGER"),
    ("a", "DOUBLE"),
    ("b", "DOUBLE"),
    ("relative_difference", "DOUBLE"),
    ("tolerance", "DOUBLE"),
    ("over", "BOOLEAN"),
    ("counted", "BOOLEAN"),
]
FRONT_COLUMNS = [
    ("step", "BIGINT"),
    ("category", "VARCHAR"),
    ("compared", "BIGINT"),
    ("over", "BIGINT"),
    ("tensors_over", "BIGINT"),
    ("over_not_counted", "BIGINT"),
    ("largest_relative_difference", "DOUBLE"),
    ("tensor", "VARCHAR"),
    ("op", "VARCHAR"),
    ("rank", "INTEGER"),
]
TABLES = ("diff", "diff_front", "diff_info")


def write_database(outcome: Outcome, path: str) -> int:
    """Write the tables; returns the rows of `diff`."""
    if os.path.exists(path):
        _check_ours(path)
    try:
        con = connect(path)
    except DatabaseError as exc:
        raise DiffInputError(str(exc)) from None
    try:
        for table in TABLES:
            con.execute(f"DROP TABLE IF EXISTS {table}")
        con.execute(f"CREATE TABLE diff ({', '.join(f'{n} {t}' for n, t in DIFF_COLUMNS)})")
        con.execute(f"CREATE TABLE diff_front ({', '.join(f'{n} {t}' for n, t in FRONT_COLUMNS)})")
        con.execute("CREATE TABLE diff_info (key VARCHAR, value VARCHAR)")
        tol = outcome.tolerance
        rows = (
            (
                c.step,
                None if c.micro_step == NO_MICRO else c.micro_step,
                c.category,
                c.vpp_stage,
                c.name,
                c.op,
                c.statistic,
                c.rank,
                c.a_rank,
                c.a,
                c.b,
                c.relative,
                c.limit,
                tol.over(c.category, c.op, c.a, c.b, c.relative),
                c.counted,
            )
            for c in outcome.findings.differing
        )
        written = insert_rows(con, "diff", DIFF_COLUMNS, rows)
        front = [
            (step, category, f.compared, f.over, len(f.over_tensors), f.over_not_counted)
            + ((f.largest.relative, f.largest.name, f.largest.op, f.largest.rank) if f.largest else (None,) * 4)
            for step, categories in sorted(outcome.findings.front.items())
            for category, f in sorted(categories.items())
        ]
        insert_rows(con, "diff_front", FRONT_COLUMNS, front)
        data = to_json(outcome)
        info = [
            (k, json.dumps(data[k])) for k in ("a", "b", "tolerance", "verdict", "first_divergence", "interpretation")
        ]
        insert_rows(con, "diff_info", [("key", "VARCHAR"), ("value", "VARCHAR")], info)
    finally:
        con.close()
    return written


def _check_ours(path: str) -> None:
    try:
        con = connect(path, read_only=True)
    except DatabaseError as exc:
        raise DiffInputError(str(exc)) from None
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    finally:
        con.close()
    if "diff_info" not in tables:
        raise DiffInputError(
            f"--db {path}: the file exists and msmon diff did not write it; name a new file "
            "(the diff tables are never written into another database)"
        )

"""The report's one read of the values (value_fold.py) against plain DuckDB aggregations over the
same rows: `per_step` row by row and the per-rank outliers, on a table that has what a run can
have: ranks that are not consecutive, two pipeline stages with the same tensor name, micro-steps
next to categories without them, NaN, inf and -inf, a rank missing at some steps, a value written
twice, steps far apart, a tensor the catalog does not list, and windows of a few steps."""

from __future__ import annotations

import math
import random

import duckdb
import pytest

from msmon.offline.results import value_plan
from msmon.offline.results.limits import Limits
from msmon.offline.results.value_fold import fold_values
from msmon.records.rows import REPLICATED_CATEGORIES

# the per_step of the report before the fold: one DuckDB aggregation over the rows (the reference)
REFERENCE = """
    WITH f AS (
      SELECT category, op, vpp_stage, name, step, micro_step, rank, value,
        CASE WHEN isfinite(value) THEN value END AS fv
      FROM metrics WHERE category NOT IN ('loss')),
    a AS (
      SELECT category, op, vpp_stage, name, step, micro_step, max(abs(fv)) AS v, bool_or(NOT isfinite(value)) AS bad,
        count(*) AS n, min(fv) AS lo, max(fv) AS hi, arg_min(rank, fv) AS lo_rank, arg_max(rank, fv) AS hi_rank,
        arg_max(rank, abs(fv)) AS v_rank
      FROM f GROUP BY ALL),
    b AS (
      SELECT category, op, vpp_stage, name, step, coalesce(micro_step, -1) AS m, min(rank) AS bad_rank, max(value) AS nf
      FROM metrics WHERE NOT isfinite(value) AND category NOT IN ('loss') GROUP BY ALL)
    SELECT a.*, b.bad_rank, b.nf FROM a LEFT JOIN b
      ON (a.category, a.op, a.vpp_stage, a.name, a.step, coalesce(a.micro_step, -1))
       = (b.category, b.op, b.vpp_stage, b.name, b.step, b.m)"""
KEY = "category, op, vpp_stage, name, step, micro_step"
COLUMNS = "v, bad, n, lo, hi, lo_rank, hi_rank, v_rank, bad_rank, nf"
REPLICATED = set(REPLICATED_CATEGORIES)  # lo, hi and their ranks are the rank spread's, for these only


def _rows(ranks: list[int]) -> list[tuple]:
    rng = random.Random(11)
    rows = []

    def add(rank, vpp, category, name, step, micro, op, value):
        rows.append((rank, vpp, category, name, step, micro, op, value, None))

    for rank in ranks:
        for step in range(4, 13):
            for micro in (0, 1):
                for name in ("blocks.0.out", "blocks.1.out"):
                    if rank == ranks[1] and step == 6:
                        continue  # this rank wrote no activation at step 6
                    for op in ("norm", "max", "min"):
                        add(rank, 0, "actv", name, step, micro, op, rng.gauss(0, 3) * (30 if rank == ranks[-1] else 1))
            for vpp in (0, 1):  # the same name in two pipeline stages
                for op in ("norm", "max", "min"):
                    add(rank, vpp, "grad_reduced", "w", step, None, op, rng.gauss(0, 1))
        for step in (0, 50, 100):  # steps far apart
            for name in ("w", "late"):  # "late": not in the catalog's tensors
                add(rank, 0, "exp_avg", name, step, None, "norm", rng.uniform(0, 2))
        add(rank, 0, "loss", "loss", 4, 0, "loss", 1.0)
    nonfinite = [math.nan, math.inf, -math.inf]
    for i, (rank, step) in enumerate([(ranks[0], 7), (ranks[2], 7), (ranks[1], 9), (ranks[3], 12)]):
        add(rank, 0, "actv", "blocks.1.out", step, 1, "norm", nonfinite[i % 3])
        add(rank, 1, "grad_reduced", "w", step, None, "max", nonfinite[(i + 1) % 3])
    add(ranks[2], 0, "actv", "blocks.0.out", 5, 0, "norm", 1e6)  # a second value at the same place
    add(ranks[0], 0, "grad_reduced", "w", 8, None, "min", -50.0)
    return rows


def _database(ranks: list[int]) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE metrics (rank INTEGER, vpp_stage INTEGER, category VARCHAR, name VARCHAR, step BIGINT, "
        "micro_step INTEGER, op VARCHAR, value DOUBLE, file_id INTEGER)"
    )
    con.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", _rows(ranks))
    con.execute("CREATE TABLE files (rank INTEGER, kind VARCHAR)")
    con.executemany("INSERT INTO files VALUES (?, 'csv')", [(r,) for r in ranks])
    con.execute("CREATE TABLE configs (rank INTEGER, ops VARCHAR)")
    con.execute("CREATE TABLE tensors (category VARCHAR, vpp_stage INTEGER, name VARCHAR, position BIGINT)")
    listed = [("actv", 0, "blocks.1.out", 0), ("actv", 0, "blocks.0.out", 1), ("grad_reduced", 0, "w", 0)]
    listed += [("grad_reduced", 1, "w", 1), ("exp_avg", 0, "w", 0)]
    con.executemany("INSERT INTO tensors VALUES (?, ?, ?, ?)", listed)
    return con


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b


def check_per_step(con: duckdb.DuckDBPyConnection, rows: str = "metrics") -> None:
    """The per_step table the fold wrote against REFERENCE over `rows`, row by row."""
    reference = REFERENCE.replace("FROM metrics", f"FROM {rows}")
    want = {r[:6]: r[6:] for r in con.execute(f"SELECT {KEY}, {COLUMNS} FROM ({reference})").fetchall()}
    got = {r[:6]: r[6:] for r in con.execute(f"SELECT {KEY}, {COLUMNS} FROM per_step").fetchall()}
    assert got.keys() == want.keys()
    for key, row in want.items():
        if key[0] not in REPLICATED:  # lo, hi and their ranks are NULL outside the replicated categories
            row = row[:3] + (None, None, None, None) + row[7:]
        assert all(_same(a, b) for a, b in zip(got[key], row)), (key, got[key], row)


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [1, 4, 5, 9]], ids=["consecutive ranks", "ranks with gaps"])
def test_per_step_folded_in_numpy_is_the_plain_duckdb_aggregation_row_by_row(ranks, monkeypatch):
    monkeypatch.setattr(value_plan, "WINDOW_CELLS", 500)  # a few steps a window
    con = _database(ranks)
    folded = fold_values(con, "'loss'", Limits())
    check_per_step(con)
    assert folded.series.ranks == ranks
    assert folded.tensors["actv"] == [(0, "blocks.1.out"), (0, "blocks.0.out")]  # the catalog's order
    assert (0, "late") in folded.tensors["exp_avg"]  # found in the values when the catalog lacks it
    assert con.execute("SELECT max(n) FROM per_step WHERE category = 'actv' AND step = 5").fetchone()[0] == 5


OUTLIERS = """
    WITH x AS (
      SELECT category, vpp_stage, name, step, coalesce(micro_step, -1) AS mstep, rank, value FROM metrics
      WHERE op = 'norm' AND category = 'actv' AND isfinite(value)),
    m AS (SELECT category, vpp_stage, name, step, mstep, median(value) AS med, count(*) AS n FROM x
      GROUP BY ALL HAVING count(*) >= 3),
    d AS (SELECT x.*, m.med, m.n, abs(x.value - m.med) AS dev FROM x
      JOIN m USING (category, vpp_stage, name, step, mstep)),
    a AS (SELECT category, vpp_stage, name, step, mstep, median(dev) AS mad FROM d GROUP BY ALL),
    z AS (SELECT d.*, a.mad, dev / greatest(1.4826 * mad, 1e-3 * abs(med), 1e-30) AS z
      FROM d JOIN a USING (category, vpp_stage, name, step, mstep))
    SELECT name, max(z), arg_max(rank, z), arg_max(step, z), arg_max(mstep, z), arg_max(value, z), arg_max(n, z)
    FROM z GROUP BY ALL ORDER BY 2 DESC"""


def test_the_per_rank_outliers_folded_in_numpy_are_the_plain_duckdb_robust_z():
    con = _database([0, 1, 2, 3])
    folded = fold_values(con, "'loss'", Limits())
    want = con.execute(OUTLIERS).fetchall()
    got = folded.outliers.result(Limits())
    assert [t["name"] for t in got["top"]] == [w[0] for w in want]
    for t, (_, z, rank, step, mstep, value, n) in zip(got["top"], want):
        assert t["z"] == pytest.approx(z, rel=1e-12)
        assert (t["rank"], t["step"], t["micro_step"], t["value"], t["ranks"]) == (rank, step, mstep, value, n)
    assert got["tensors"] == 2 and got["max_ranks"] == 5  # the value written twice counts as a row

"""The row charts' per-rank points (rank_points.py), folded from a real DuckDB `metrics` table
(value_fold.py), against the same points, band, medians and robust z computed here in plain
Python from the rows: merged steps, two tensors in a row, micro-steps, non-finite values, a
rank with no value at a step and a value written twice."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys

import duckdb
import pytest

from msmon.offline.results.limits import Limits  # noqa: E402
from msmon.offline.results.robust import MAD_FLOOR, MAD_SCALE, TINY  # noqa: E402
from msmon.offline.results.value_fold import fold_values  # noqa: E402

RANKS = [0, 1, 2, 3, 5, 8, 9]  # not 0..n-1: a rank's slot is its place in the list
OPS = ["norm", "max"]
ROWS = {"a": 0, "b": 0, "c": 1}  # tensors a and b share row 0
FIRST, WIDTH, COLUMNS = 3, 2, 4  # steps 3..10, two per column


def _rows() -> list[tuple]:
    rng = random.Random(7)
    rows = []
    for rank in RANKS:
        for name in ROWS:
            for step in range(FIRST, FIRST + WIDTH * COLUMNS):
                if rank == 5 and step in (5, 6):
                    continue  # rank 5 wrote nothing in column 1
                for micro in (0, 1):
                    for op in OPS:
                        value = rng.uniform(-3, 3) * (40 if rank == 9 and name == "c" else 1)
                        if rank == 2 and name == "b" and step == 8 and op == "norm":
                            value = math.nan if micro else math.inf
                        rows.append((rank, 0, "actv", name, step, micro, op, value, None))
    rows.append((1, 0, "actv", "a", 4, 0, "norm", 1e6, None))  # the same place written twice: the larger counts
    rows.append((3, 0, "other", "a", 4, 0, "norm", 1e9, None))  # another category: not read
    return rows


@pytest.fixture(scope="module")
def points():
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE metrics (rank INTEGER, vpp_stage INTEGER, category VARCHAR, name VARCHAR, step BIGINT, "
        "micro_step INTEGER, op VARCHAR, value DOUBLE, file_id INTEGER)"
    )
    rows = _rows()
    con.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.execute("CREATE TABLE files (rank INTEGER, kind VARCHAR)")
    con.executemany("INSERT INTO files VALUES (?, 'csv')", [(r,) for r in RANKS])
    con.execute("CREATE TABLE configs (rank INTEGER, ops VARCHAR)")
    con.execute("CREATE TABLE tensors (category VARCHAR, vpp_stage INTEGER, name VARCHAR, position BIGINT)")
    con.executemany("INSERT INTO tensors VALUES ('actv', 0, ?, ?)", [(name, i) for i, name in enumerate(ROWS)])
    # four columns of two steps, two tensors a row (a and b share row 0)
    folded = fold_values(con, "'loss'", Limits(max_steps=COLUMNS, max_rows=2), keep_points=True)
    assert folded.series.ranks == RANKS and folded.steps.first == FIRST and folded.steps.width == WIDTH
    return rows, folded.points["actv"].points(OPS, 1)


def _expected(rows: list[tuple]) -> dict[tuple[int, str, int, int], tuple[float | None, bool]]:
    """(rank, op, row, column) -> (largest finite |value| or None, any non-finite), plain Python."""
    found: dict[tuple[int, str, int, int], list[float]] = {}
    for rank, _, category, name, step, _, op, value, _ in rows:
        if category == "actv":
            found.setdefault((rank, op, ROWS[name], (step - FIRST) // WIDTH), []).append(value)
    out = {}
    for key, values in found.items():
        finite = [abs(v) for v in values if math.isfinite(v)]
        out[key] = (max(finite, default=None), len(finite) < len(values))
    return out


def test_a_point_is_the_largest_finite_abs_value_of_its_rows_tensors_steps_and_micro_steps_per_rank(points):
    rows, got = points
    want = _expected(rows)
    for slot, rank in enumerate(RANKS):
        for i, op in enumerate(OPS):
            for row in range(2):
                for column in range(COLUMNS):
                    v, bad = want.get((rank, op, row, column), (None, False))
                    value = got.v[slot, i, row, column]
                    assert (None if math.isnan(value) else value) == v, (rank, op, row, column)
                    assert bool(got.bad[slot, i, row, column]) == bad, (rank, op, row, column)
    assert got.v[RANKS.index(1), 0, 0, 0] == 1e6
    assert got.bad[RANKS.index(2), 0, 0, 2] and not got.bad[RANKS.index(2), 1, 0, 2]


def test_the_band_is_min_median_and_max_over_the_ranks_that_have_a_point_and_flags_any_non_finite(points):
    rows, got = points
    want = _expected(rows)
    lo, med, hi, bad = got.band()
    for i, op in enumerate(OPS):
        for row in range(2):
            for column in range(COLUMNS):
                at = [want[k][0] for r in RANKS if (k := (r, op, row, column)) in want and want[k][0] is not None]
                assert (lo[i, row, column], hi[i, row, column]) == (min(at), max(at))
                assert med[i, row, column] == pytest.approx(statistics.median(at), rel=1e-12)
                flagged = any(want[k][1] for r in RANKS if (k := (r, op, row, column)) in want)
                assert bool(bad[i, row, column]) == flagged
    assert bad[0, 0, 2] and not bad[1, 0, 2]


def test_the_departing_ranks_are_the_largest_robust_z_over_columns_a_non_finite_point_first(points):
    rows, got = points
    want = _expected(rows)
    expected = []
    for row in range(2):
        z: dict[int, float] = {}
        for column in range(COLUMNS):
            here = {r: want[k] for r in RANKS if (k := (r, "norm", row, column)) in want}
            finite = [v for v, _ in here.values() if v is not None]
            med = statistics.median(finite)
            mad = statistics.median([abs(v - med) for v in finite])
            scale = max(MAD_SCALE * mad, MAD_FLOOR * abs(med), TINY)
            for r, (v, bad) in here.items():
                score = math.inf if bad else abs(v - med) / scale
                z[r] = max(z.get(r, 0.0), score)
        expected.append(sorted((r for r in z if z[r] > 0), key=lambda r: (-z[r], r))[:3])
    assert got.departing("norm", 3, RANKS) == expected
    assert expected[0][0] == 2 and expected[1][0] == 9  # the non-finite point, then the 40x rank


def test_the_msmon_command_line_starts_without_importing_numpy_or_duckdb():
    """numpy and duckdb come with the db extra: `msmon run` and `msmon --help` never need them."""
    code = "import sys; from msmon.launcher.cli import main; print(sorted({'numpy', 'duckdb'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout

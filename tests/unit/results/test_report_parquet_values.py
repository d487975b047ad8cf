"""The report's values read straight from Parquet files with pyarrow (parquet_values.py) against
plain DuckDB aggregations over the same rows through the `metrics` view: `per_step` row by row
and the per-rank outliers, on files written by msmon's own writer with what a run can have
(ranks with gaps, one name in two pipeline stages, micro-steps next to categories without,
NaN, inf and -inf, a rank missing at some steps, steps far apart, groups of steps smaller than
a file); a value written twice, a file closed after `msmon db` with a tensor the catalog lacks,
and files another writer made (several ranks in a file, nulls, no msmon footer)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_report_value_fold import _rows as value_fold_rows
from test_report_value_fold import check_per_step

from msmon.launcher.cli import main
from msmon.offline.results import parquet_values, value_fold
from msmon.offline.results.limits import Limits
from msmon.offline.results.value_fold import fold_values
from msmon.offline.results.value_plan import make_plan
from msmon.records.parquet_files import SCHEMA, RollingParquet
from msmon.records.parquet_layout import SPANS_KEY, block_dir, file_name
from msmon.records.runs import NO_RUN

ROLL = 4  # steps per file: the groups of steps below end inside files too


def _rows(ranks: list[int]) -> list[tuple]:
    """(rank, vpp_stage, category, name, step, micro_step, op, value): test_report_value_fold's run
    with one value at each place, the last written (a value written twice is the test below)."""
    placed = {row[:7]: row[:8] for row in value_fold_rows(ranks)}
    return list(placed.values())


def _write(out: Path, rows: list[tuple], row_group_rows: int = 16) -> None:
    """Each rank's rows through msmon's Parquet writer, a window of ROLL steps a file."""
    for rank in sorted({r[0] for r in rows}):
        files = RollingParquet(block_dir(str(out), NO_RUN, rank), rank, NO_RUN, ROLL, 128 << 20, row_group_rows)
        mine = sorted((r for r in rows if r[0] == rank), key=lambda r: r[4] // ROLL)
        for window in sorted({r[4] // ROLL for r in mine}):
            chunk = [r for r in mine if r[4] // ROLL == window]
            ids = files.tensor_ids([(r[2], r[1], r[3], r[5]) for r in chunk], lambda key: key)
            ops = files.op_ids([r[6] for r in chunk])
            files.add(np.array([r[4] for r in chunk]), ids, ops, np.array([r[7] for r in chunk]))
        files.close()


def _database(out: Path, path: Path) -> duckdb.DuckDBPyConnection:
    result = CliRunner().invoke(main, ["db", "-d", str(out), "-o", str(path), "--no-progress"])
    assert result.exit_code == 0, result.output
    return duckdb.connect(str(path))


def _read_by(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many windows each read made: `parquet` (pyarrow) and `duckdb` (the `metrics` view)."""
    made = {"parquet": 0, "duckdb": 0}
    parquet, duck = parquet_values.ParquetWindows.windows, value_fold._duckdb_windows

    def counted(kind, windows):
        def wrapper(*args, **kwargs):
            for item in windows(*args, **kwargs):
                made[kind] += 1
                yield item

        return wrapper

    monkeypatch.setattr(parquet_values.ParquetWindows, "windows", counted("parquet", parquet))
    monkeypatch.setattr(value_fold, "_duckdb_windows", counted("duckdb", duck))
    return made


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [1, 4, 5, 9]], ids=["consecutive ranks", "ranks with gaps"])
def test_values_read_from_parquet_fold_as_the_plain_duckdb_aggregation_row_by_row(ranks, tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_values, "GROUP_CELLS", 700)  # groups of a few steps, ending inside files
    _write(tmp_path / "out", _rows(ranks))
    con = _database(tmp_path / "out", tmp_path / "run.duckdb")
    made = _read_by(monkeypatch)
    folded = fold_values(con, "'loss'", Limits())
    assert made["parquet"] > len(folded.plan.categories) and made["duckdb"] == 0  # several groups, no DuckDB read
    check_per_step(con)
    assert folded.series.ranks == ranks
    assert folded.tensors["grad_reduced"] == [(0, "w"), (1, "w")]


def test_the_per_rank_outliers_read_from_parquet_are_the_ones_read_through_duckdb(tmp_path, monkeypatch):
    _write(tmp_path / "out", _rows([0, 1, 2, 3, 4]))
    con = _database(tmp_path / "out", tmp_path / "run.duckdb")
    from_parquet = fold_values(con, "'loss'", Limits())
    monkeypatch.setattr(value_fold, "parquet_files", lambda con, excluded: None)
    through_duckdb = fold_values(con, "'loss'", Limits())
    assert from_parquet.outliers.result(Limits()) == through_duckdb.outliers.result(Limits())
    assert from_parquet.charts == through_duckdb.charts


def test_the_plan_from_the_footers_is_the_plan_a_scan_of_the_values_makes(tmp_path):
    _write(tmp_path / "out", _rows([0, 1, 2, 3]))
    con = _database(tmp_path / "out", tmp_path / "run.duckdb")
    files = parquet_values.parquet_files(con, "'loss'")
    assert files and len(files) == 4 * 6  # per rank: steps 0, 4..7, 8..11, 12, 50 and 100 (ROLL steps a file)
    spans = parquet_values.ParquetWindows(files).category_spans()
    assert spans is not None and [s[0] for s in spans] == ["actv", "exp_avg", "grad_reduced", "loss"]
    assert make_plan(con, "'loss'", spans=spans) == make_plan(con, "'loss'")


def test_a_value_written_twice_sends_the_fold_to_duckdbs_read_which_keeps_both(tmp_path, monkeypatch):
    rows = _rows([0, 1, 2, 3])
    rows.append((2, 0, "actv", "blocks.0.out", 5, 0, "norm", -1e6))  # a second value at the same place
    _write(tmp_path / "out", rows)
    con = _database(tmp_path / "out", tmp_path / "run.duckdb")
    made = _read_by(monkeypatch)
    fold_values(con, "'loss'", Limits())
    assert made["duckdb"] > 0
    check_per_step(con)
    assert con.execute("SELECT max(n) FROM per_step WHERE category = 'actv' AND step = 5").fetchone()[0] == 5


def test_a_file_closed_after_msmon_db_with_a_tensor_the_catalog_lacks_is_placed_by_a_plan_from_the_values(
    tmp_path, monkeypatch
):
    _write(tmp_path / "out", _rows([0, 1, 2, 3]))
    con = _database(tmp_path / "out", tmp_path / "run.duckdb")
    late = [(r, 0, "exp_avg", "later", 200, None, "norm", float(r)) for r in range(4)]
    _write(tmp_path / "out", late)  # the job goes on: each rank closes one more file
    made = _read_by(monkeypatch)
    folded = fold_values(con, "'loss'", Limits())
    assert made["parquet"] > 0 and made["duckdb"] == 0
    assert (0, "later") in folded.tensors["exp_avg"]
    check_per_step(con)


def test_files_of_another_writer_with_several_ranks_nulls_and_no_msmon_footer_are_read_alike(tmp_path, monkeypatch):
    rows = _rows([0, 1, 2, 3])
    rows += [(1, 0, "actv", "blocks.0.out", 4, 0, "zeros", None)]  # a NULL value: no value
    block = Path(block_dir(str(tmp_path / "out"), NO_RUN, 0))
    block.mkdir(parents=True)
    rng = random.Random(3)
    rng.shuffle(rows)  # no order a reader could count on
    for seq, part in enumerate((rows[: len(rows) // 2], rows[len(rows) // 2 :])):  # every rank in both files
        columns = list(zip(*[(NO_RUN, *r) for r in part]))
        table = pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(columns, SCHEMA)], schema=SCHEMA)
        pq.write_table(table, block / file_name(0, seq), row_group_size=100, use_dictionary=False)
    con = _database(tmp_path / "out", tmp_path / "run.duckdb")
    files = parquet_values.parquet_files(con, "'loss'")
    assert files is not None and parquet_values.ParquetWindows(files).category_spans() is None
    assert all(SPANS_KEY.encode() not in (pq.read_metadata(f).metadata or {}) for f in files)
    made = _read_by(monkeypatch)
    fold_values(con, "'loss'", Limits())
    assert made["parquet"] > 0 and made["duckdb"] == 0
    check_per_step(con, "(SELECT * FROM metrics WHERE value IS NOT NULL)")  # a NULL is no value, as in a CSV


def test_the_writer_says_each_categorys_steps_and_micro_steps_in_the_footer(tmp_path):
    _write(tmp_path / "out", _rows([0, 1, 2, 3]), row_group_rows=7)  # several row groups a file
    for path in sorted((tmp_path / "out").rglob("*.parquet")):
        said = json.loads(pq.read_metadata(path).metadata[SPANS_KEY.encode()])
        table = pq.read_table(path).to_pylist()
        want: dict[str, list[int]] = {}
        for row in table:
            micro = -1 if row["micro_step"] is None else row["micro_step"]
            have = want.setdefault(row["category"], [row["step"], row["step"], micro, micro])
            have[:] = [min(have[0], row["step"]), max(have[1], row["step"]), min(have[2], micro), max(have[3], micro)]
        assert said == want, path


def test_a_file_gone_once_its_footer_was_read_sends_the_fold_to_duckdbs_read(tmp_path, monkeypatch):
    _write(tmp_path / "out", _rows([0, 1, 2, 3]))
    con = _database(tmp_path / "out", tmp_path / "run.duckdb")
    made = _read_by(monkeypatch)
    gone = next((tmp_path / "out").rglob("part-00002-00002.parquet"))
    plan = value_fold.make_plan

    def removing(*args, **kwargs):  # between the footers' read and the rows'
        gone.unlink(missing_ok=True)
        return plan(*args, **kwargs)

    monkeypatch.setattr(value_fold, "make_plan", removing)
    fold_values(con, "'loss'", Limits())
    assert made["duckdb"] > 0
    check_per_step(con)  # the rows of the files still there, as the view reads them

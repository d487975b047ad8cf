"""`msmon db` as a catalog of Parquet files, and `msmon export --to parquet`: a CSV run exported
reads back as the same rows, tensor order and report as the CSV run loaded; the view follows the
files on disk; earlier copies are not counted twice; a bad file is named and left out; a
database of schema version 1 is brought up to date."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)
import pytest
import torch
from click.testing import CliRunner

from conftest import ROOT  # noqa: E402
from msmon.launcher.cli import main  # noqa: E402
from msmon.offline.results.report_html import build  # noqa: E402
from msmon.output.sinks.parquet_sink import ParquetSink  # noqa: E402
from msmon.records.rows import RowKey, StepRecord  # noqa: E402
from msmon.records.runs import NO_RUN  # noqa: E402

RANKS, STEPS, TENSORS, ROLL = 3, 7, 10, 3
# the rank said to hold a value that several ranks share (a replicated tensor, a count of 0) is
# any of them: DuckDB's arg_max picks one by the order it meets them in
HOLDERS = ("ranks", "before_rank", "after_rank", "min_rank", "max_rank")
ROWS = "SELECT rank, vpp_stage, category, name, step, micro_step, op, value FROM metrics"


def without_holders(data: object) -> object:
    if isinstance(data, dict):
        return {k: without_holders(v) for k, v in data.items() if k not in HOLDERS}
    if isinstance(data, list):
        return [without_holders(v) for v in data]
    return data


def msmon(*argv: str) -> str:
    result = CliRunner().invoke(main, list(argv))
    assert result.exit_code == 0, result.output
    return result.output


def rows(database: Path) -> list[tuple]:
    con = duckdb.connect(str(database), read_only=True)
    try:
        return sorted((*r[:7], repr(r[7])) for r in con.execute(ROWS).fetchall())  # repr: NaN equals NaN
    finally:
        con.close()


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory) -> Path:
    """The benchmark's generator at test size, in msmon's CSV layout (loss rows and NaNs included)."""
    out = tmp_path_factory.mktemp("catalog") / "csv"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "synthetic_output.py"), "-o", str(out), "--ranks", str(RANKS)]
        + ["--steps", str(STEPS), "--tensors", str(TENSORS), "--window", "2", "--loss", "--processes", "1"],
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        timeout=120,
    )
    return out


def exported(csv_run: Path, into: Path) -> Path:
    shutil.copytree(csv_run, into)
    msmon("export", "-d", str(into), "--to", "parquet", "--roll-steps", str(ROLL))
    return into


def test_an_exported_run_reads_back_as_the_csv_run_rows_tensor_order_and_report(csv_run, tmp_path):
    out = exported(csv_run, tmp_path / "exported")
    files = sorted((out / "parquet" / f"run={NO_RUN}" / "rank_block=0").iterdir())
    assert len(files) == RANKS * math.ceil(STEPS / ROLL)
    msmon("db", "-d", str(csv_run), "-o", str(tmp_path / "csv.duckdb"))
    output = msmon("db", "-d", str(out), "-o", str(tmp_path / "pq.duckdb"))
    assert f"{len(files)} Parquet files" in output and "CSV files left out" in output
    assert rows(tmp_path / "pq.duckdb") == rows(tmp_path / "csv.duckdb")
    pages = []
    for name in ("csv", "pq"):
        con = duckdb.connect(str(tmp_path / f"{name}.duckdb"), read_only=True)
        assert con.execute("SELECT count(*) FROM metrics_wide").fetchone()[0] > 0  # the views over `metrics`
        order = con.execute("SELECT category, vpp_stage, name FROM tensors ORDER BY category, position").fetchall()
        data = build(con, str(tmp_path / f"{name}.html"), "run")
        con.close()
        for where in ("files", "roots"):  # 81 CSV and JSON files against 9 Parquet and the JSON; another path
            data["overview"].pop(where)
        pages.append((order, {k: v for k, v in data.items() if k not in ("bytes", "generated")}))
    assert pages[0][0] == pages[1][0]
    differ = [key for key, value in pages[0][1].items() if without_holders(pages[1][1][key]) != without_holders(value)]
    assert differ == [], differ


def test_export_leaves_a_rank_that_has_parquet_files_as_it_is(csv_run, tmp_path):
    out = exported(csv_run, tmp_path / "exported")
    before = {p: p.stat().st_mtime_ns for p in (out / "parquet").rglob("*.parquet")}
    output = msmon("export", "-d", str(out), "--to", "parquet")
    assert output.count("has Parquet files in run unlabelled already") == RANKS
    assert {p: p.stat().st_mtime_ns for p in (out / "parquet").rglob("*.parquet")} == before


def test_rows_copied_from_csv_before_the_export_are_not_counted_twice(csv_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(csv_run, out)
    database = tmp_path / "run.duckdb"
    msmon("db", "-d", str(out), "-o", str(database))
    before = rows(database)
    msmon("export", "-d", str(out), "--to", "parquet", "--roll-steps", str(ROLL))
    msmon("db", "-d", str(out), "-o", str(database))
    assert rows(database) == before
    con = duckdb.connect(str(database), read_only=True)
    assert con.execute("SELECT count(*) FROM loaded_metrics").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM files WHERE kind = 'csv'").fetchone() == (0,)


def test_the_view_reads_files_closed_after_the_load_and_leaves_a_bad_one_out(csv_run, tmp_path):
    out = exported(csv_run, tmp_path / "exported")
    database = tmp_path / "run.duckdb"
    msmon("db", "-d", str(out), "-o", str(database))
    count = len(rows(database))
    sink = ParquetSink(str(out), NO_RUN, 6, ROLL, 128 << 20)  # the job goes on: rank 0 closes another file
    sink.write(StepRecord(STEPS + 5, 0, ["norm"], [RowKey("grad_reduced", "late.weight")], table=torch.ones(1, 1)))
    sink.close()
    assert len(rows(database)) == count + 1  # no new load needed
    block = out / "parquet" / f"run={NO_RUN}" / "rank_block=0"
    (block / "part-00002-00099.parquet").write_bytes(b"not parquet at all")  # a copy cut short, say
    output = msmon("db", "-d", str(out), "-o", str(database))
    assert "part-00002-00099.parquet: cannot be read as Parquet" in output
    assert len(rows(database)) == count + 1


def test_a_schema_version_1_database_is_brought_up_to_date_and_read_as_it_is(csv_run, tmp_path):
    database = tmp_path / "old.duckdb"
    msmon("db", "-d", str(csv_run), "-o", str(database))
    expected = rows(database)
    con = duckdb.connect(str(database))  # as version 1 wrote it: `metrics` was the table
    con.execute("DROP VIEW metrics")
    con.execute("ALTER TABLE loaded_metrics RENAME TO metrics")
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    con.close()
    msmon("report", "--db", str(database), "-o", str(tmp_path / "old.html"))  # version 1 is read as it is
    assert rows(database) == expected
    output = msmon("db", "-d", str(csv_run), "-o", str(database))
    assert "0 new, 0 grown, 0 changed and reloaded" in output
    con = duckdb.connect(str(database), read_only=True)
    assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
    assert con.execute("SELECT table_type FROM information_schema.tables WHERE table_name = 'metrics'").fetchone() == (
        "VIEW",
    )
    con.close()
    assert rows(database) == expected


def test_a_report_on_parquet_files_that_moved_says_what_to_do_in_one_line(csv_run, tmp_path):
    out = exported(csv_run, tmp_path / "exported")
    database = tmp_path / "run.duckdb"
    msmon("db", "-d", str(out), "-o", str(database))
    out.rename(tmp_path / "moved")
    result = CliRunner().invoke(main, ["report", "--db", str(database), "-o", str(tmp_path / "report.html")])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {out}/parquet/run={NO_RUN}/*/part-*.parquet: no Parquet file there any")
    assert "run msmon db on the output where it is now" in result.output and result.output.count("\n") == 1


def test_tensorboard_scalars_of_a_rank_in_parquet_are_left_out_and_its_histograms_loaded(tmp_path):
    """format: ["tensorboard", "parquet"]: the same values in float32 and in the CSV's rounding; the
    Parquet ones are kept, each once, and the event file still gives its histograms."""
    from msmon.output.sinks.tensorboard_sink import TensorBoardSink

    out = tmp_path / "out"
    rank_dir = out / "Dec06_10-00-00-rank0-abcdef12"
    rank_dir.mkdir(parents=True)
    sinks = [TensorBoardSink(str(rank_dir)), ParquetSink(str(out), NO_RUN, 6, ROLL, 128 << 20)]
    keys = [RowKey("grad_reduced", "a.weight"), RowKey("exp_avg", "a.weight")]
    for step in range(4):
        histogram = ("0:a.weight/rank0/update_hist", [-1.0, 0.0, 1.0], [2.0, 3.0])
        record = StepRecord(step, 0, ["norm", "max"], keys, table=torch.rand(2, 2, dtype=torch.float64))
        record.histograms = [histogram]
        for sink in sinks:
            sink.write(record)
    for sink in sinks:
        sink.close()
    output = msmon("db", "-d", str(out), "-o", str(tmp_path / "run.duckdb"))
    assert "16 TensorBoard scalars left out" in output and "2 Parquet files" in output
    con = duckdb.connect(str(tmp_path / "run.duckdb"), read_only=True)
    assert con.execute("SELECT count(*), count(DISTINCT (category, name, step, op)) FROM metrics").fetchone() == (
        16,
        16,
    )
    assert con.execute("SELECT count(*) FROM histograms").fetchone() == (4,)

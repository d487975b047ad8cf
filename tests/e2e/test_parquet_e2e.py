"""`format: ["csv", "parquet"]` on a real 2-rank torchrun job under `msmon run` (gloo): each rank
writes a handful of Parquet files (one per parquet_roll_steps steps, not one per step), DuckDB's
read_parquet over them returns exactly the CSV's values row for row (the CSV read with Python's
csv module), and `msmon db`, `analyse` and `report` work from that output, reading the
statistics from the Parquet files."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)
import pytest

from conftest import ROOT, run_job
from msmon.records.layout import CSV_FILE  # noqa: E402
from msmon.records.runs import runs_of  # noqa: E402

SCRIPTS = ROOT / "tests" / "scripts"
STEPS, ROLL = 6, 2
CONFIG = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "loss_distribution": True,
    "format": ["csv", "parquet"],
    "parquet_roll_steps": ROLL,
    "ops": ["norm", "min", "max", "mean", "nans"],
    "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
}
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """The output directory of one `msmon run` of the DDP script on two ranks."""
    base = tmp_path_factory.mktemp("parquet")
    config, out = base / "monitor.json", base / "out"
    config.write_text(json.dumps(CONFIG))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    proc = run_job(
        [sys.executable, "-m", "msmon.launcher", "run", "--config", str(config), "--output-dir", str(out)]
        + ["--standalone", "--nproc-per-node", "2", "--", str(SCRIPTS / "launcher_ddp.py"), "--steps", str(STEPS)],
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def rank_dirs(out: Path) -> dict[int, Path]:
    found = {int(d.name.split("-rank")[1].split("-")[0]): d for d in out.glob("*-rank*-*")}
    assert sorted(found) == [0, 1]
    return found


def csv_rows(out: Path) -> list[tuple]:
    """Every value of the CSV files, read with Python's csv module: (rank, vpp, category, name,
    step, micro_step, op, repr(value))."""
    rows = []
    for rank, directory in rank_dirs(out).items():
        for path in directory.glob("*.csv"):
            match = CSV_FILE.match(path.name)
            if match is None:
                continue
            with open(path, newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                ops = [c for c in reader.fieldnames or [] if c not in ("vpp_stage", "name", "step", "micro_step")]
                for row in reader:
                    micro = int(row["micro_step"]) if row.get("micro_step") else None
                    for op in ops:
                        key = (rank, int(row["vpp_stage"]), match["category"], row["name"], int(row["step"]), micro)
                        rows.append((*key, op, repr(float(row[op]))))
    return sorted(rows)


def test_each_rank_writes_one_parquet_file_per_roll_window_named_by_its_run(job):
    (run_id,) = {runs_of(str(d))[0][0] for d in rank_dirs(job).values()}
    block = job / "parquet" / f"run={run_id}" / "rank_block=0"
    names = sorted(os.listdir(block))
    windows = math.ceil(STEPS / ROLL)
    assert names == [f"part-0000{rank}-0000{seq}.parquet" for rank in (0, 1) for seq in range(windows)]
    csv_files = sum(1 for d in rank_dirs(job).values() for p in d.glob("*.csv") if CSV_FILE.match(p.name))
    assert csv_files >= 10 * len(names)  # CSV: a file per category and step; Parquet: a few per rank


def test_read_parquet_returns_exactly_the_csv_values_row_for_row(job):
    con = duckdb.connect()
    got = con.execute(
        "SELECT rank, vpp_stage, category, name, step, micro_step, op, value, run_id, run, rank_block "
        "FROM read_parquet(?, hive_partitioning = true)",
        [str(job / "parquet" / "*" / "*" / "*.parquet")],
    ).fetchall()
    expected = csv_rows(job)
    assert len(expected) > 1000
    assert sorted((*r[:7], repr(r[7])) for r in got) == expected
    assert {r[2] for r in got} >= {"actv", "actv_grad", "grad_unreduced", "grad_reduced", "exp_avg", "loss"}
    (run_id,) = {r[8] for r in got}
    assert {r[9] for r in got} == {run_id} and {r[10] for r in got} == {0}


def test_msmon_db_analyse_and_report_work_from_the_parquet_output(job, tmp_path):
    database, page = tmp_path / "run.duckdb", tmp_path / "report.html"
    msmon = [sys.executable, "-m", "msmon.launcher"]
    loaded = subprocess.run([*msmon, "db", "-d", str(job), "-o", str(database)], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert "6 Parquet files" in loaded.stderr and "CSV files left out" in loaded.stderr
    con = duckdb.connect(str(database), read_only=True)
    rows = con.execute("SELECT rank, vpp_stage, category, name, step, micro_step, op, value FROM metrics").fetchall()
    assert sorted((*r[:7], repr(r[7])) for r in rows) == csv_rows(job)  # from Parquet, nothing twice
    assert con.execute("SELECT count(*) FROM loaded_metrics").fetchone() == (0,)
    assert con.execute("SELECT rank, parquet_files, csv_files FROM ranks WHERE parquet_files > 0").fetchall() == [
        (0, 3, 0),
        (1, 3, 0),
    ]
    con.close()
    analysed = subprocess.run([*msmon, "analyse", "-d", str(job / "anomaly_detected")], capture_output=True, text=True)
    assert analysed.returncode == 0, analysed.stderr
    assert "No anomaly" in analysed.stdout
    reported = subprocess.run(
        [*msmon, "report", "--db", str(database), "-o", str(page)], capture_output=True, text=True
    )
    assert reported.returncode == 0, reported.stderr
    text = page.read_text()
    assert "grad_reduced" in text and "head.weight" in text

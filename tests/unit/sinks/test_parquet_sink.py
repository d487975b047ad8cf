"""The `parquet` format (output/sinks/parquet_sink.py): `msmon db`'s long rows plus the run id, a
few files per rank in the Hive layout, each whole once its name ends in `.parquet`; read back
with pyarrow and DuckDB, and compared with what the CSV sink writes for the same steps."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import ROOT  # noqa: E402
from msmon import TrainerMon  # noqa: E402
from msmon.config import ConfigError, parse_config  # noqa: E402
from msmon.output.sinks import check_formats, required_modules  # noqa: E402
from msmon.output.sinks.csv_sink import CsvSink  # noqa: E402
from msmon.output.sinks.parquet_sink import ParquetSink  # noqa: E402
from msmon.records.parquet_layout import PARQUET_FILE, TENSORS_KEY, UNFINISHED_FILE  # noqa: E402
from msmon.records.rows import RowKey, StepRecord  # noqa: E402

OPS = ["norm", "min", "max", "mean", "nans"]
KEYS = [RowKey("actv", f"layers.{i}.output", 0, micro) for i in range(3) for micro in (0, 1)] + [
    RowKey("grad_reduced", "w,with a comma"),
    RowKey("exp_avg_sq", "layers.0.weight", 1),
]


def step_table(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    table = torch.randn(len(KEYS), len(OPS), generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -12, 6, (len(KEYS), len(OPS)), generator=gen
    )
    table[:, OPS.index("nans")] = torch.randint(0, 3, (len(KEYS),), generator=gen).double()
    if step == 4:
        table[1, 0], table[2, 1], table[3, 2] = math.nan, math.inf, -math.inf
    return table


def write_steps(sink, steps: range, rank: int = 3) -> None:
    for step in steps:
        sink.write(StepRecord(step, rank, OPS, KEYS, table=step_table(step)))
    sink.close()


def parquet_files(base: Path) -> list[Path]:
    return sorted(base.rglob("*.parquet"))


def test_a_file_per_window_of_roll_steps_in_the_hive_layout_with_the_run_id_on_every_row(tmp_path):
    write_steps(ParquetSink(str(tmp_path), "run-a", 6, 4, 128 << 20), range(10))
    files = parquet_files(tmp_path)
    block = tmp_path / "parquet" / "run=run-a" / "rank_block=0"
    assert files == [block / f"part-00003-0000{seq}.parquet" for seq in range(3)]  # steps 0-3, 4-7, 8-9
    for seq, path in enumerate(files):
        table = pq.read_table(path)
        assert table.schema.names == [
            "run_id",
            "rank",
            "vpp_stage",
            "category",
            "name",
            "step",
            "micro_step",
            "op",
            "value",
        ]
        rows = table.to_pylist()
        assert {r["run_id"] for r in rows} == {"run-a"} and {r["rank"] for r in rows} == {3}
        assert sorted({r["step"] for r in rows}) == list(range(4 * seq, min(4 * seq + 4, 10)))
        assert len(rows) == len({r["step"] for r in rows}) * len(KEYS) * len(OPS)


def test_values_are_the_csv_sinks_row_for_row(tmp_path):
    """Every value the CSV sink writes (read back with Python's csv module), and no other."""
    (tmp_path / "csv").mkdir()
    write_steps(CsvSink(str(tmp_path / "csv"), 6, 1), range(6))
    write_steps(ParquetSink(str(tmp_path), "run-a", 6, 4, 128 << 20), range(6))
    expected = {}
    for path in (tmp_path / "csv").glob("*.csv"):
        category = path.name.rsplit("_", 1)[0]
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                micro = int(row["micro_step"]) if row.get("micro_step") else None
                for op in OPS:
                    key = (int(row["vpp_stage"]), category, row["name"], int(row["step"]), micro, op)
                    expected[key] = repr(float(row[op]))  # repr: NaN equals NaN
    con = duckdb.connect()
    got = con.execute(
        "SELECT vpp_stage, category, name, step, micro_step, op, value FROM read_parquet(?, hive_partitioning = true)",
        [str(tmp_path / "parquet" / "**" / "*.parquet")],
    ).fetchall()
    assert len(got) == len(expected) == 6 * len(KEYS) * len(OPS)
    assert {r[:6]: repr(r[6]) for r in got} == expected
    assert {r[6] for r in got if r[5] == "nans"} <= {0.0, 1.0, 2.0}


def test_a_filter_on_nan_finds_every_nan_a_row_group_holds_beside_finite_values(tmp_path):
    """A writer leaves NaN out of a column's min and max; with those statistics DuckDB skipped the
    row group of [1.5, nan] for `isnan(value)` and found no NaN at all. The value column has none."""
    sink = ParquetSink(str(tmp_path), "run-a", 6, 100, 128 << 20)
    keys = [RowKey("grad_reduced", "a.weight"), RowKey("grad_reduced", "b.weight")]
    for step in range(3):
        sink.write(StepRecord(step, 0, ["norm"], keys, table=torch.tensor([[1.5], [math.nan if step == 1 else 2.5]])))
    sink.close()
    (path,) = parquet_files(tmp_path)
    con = duckdb.connect()
    assert con.execute("SELECT step, name FROM read_parquet(?) WHERE isnan(value)", [str(path)]).fetchall() == [
        (1, "b.weight")
    ]
    assert con.execute("SELECT count(*) FROM read_parquet(?) WHERE value > 2", [str(path)]).fetchone() == (
        3,
    )  # NaN too
    meta = pq.ParquetFile(path).metadata.row_group(0)
    columns = [meta.column(i) for i in range(meta.num_columns)]
    assert [c.path_in_schema for c in columns if not c.is_stats_set] == ["value"]


def test_row_groups_are_large_zstd_and_the_names_dictionary_encoded(tmp_path):
    sink = ParquetSink(str(tmp_path), "run-a", 6, 100, 128 << 20, row_group_rows=100)
    write_steps(sink, range(7))  # 40 rows a step: row groups at 120, 120, 40 rows (the last at close)
    (path,) = parquet_files(tmp_path)
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [120, 120, 40]
    columns = {meta.schema.column(i).name: i for i in range(meta.num_columns)}
    for i in range(meta.num_row_groups):
        for name in ("run_id", "category", "name", "op"):
            chunk = meta.row_group(i).column(columns[name])
            assert chunk.compression == "ZSTD" and "RLE_DICTIONARY" in chunk.encodings, (name, chunk.encodings)
    assert meta.row_group(0).column(columns["value"]).compression == "ZSTD"
    order = json.loads(meta.metadata[TENSORS_KEY.encode()])  # the tensors in the order recorded
    assert order == [["actv", 0, f"layers.{i}.output"] for i in range(3)] + [
        ["grad_reduced", 0, "w,with a comma"],
        ["exp_avg_sq", 1, "layers.0.weight"],
    ]


def test_a_file_rolls_past_roll_bytes_before_its_window_ends(tmp_path):
    sink = ParquetSink(str(tmp_path), "run-a", 6, 1000, 1, row_group_rows=80)  # every row group fills a file
    write_steps(sink, range(6))
    files = parquet_files(tmp_path)
    assert len(files) == 3 and all(pq.ParquetFile(p).metadata.num_rows == 80 for p in files)


def test_a_restarted_writer_adds_files_and_never_replaces_one(tmp_path):
    write_steps(ParquetSink(str(tmp_path), "run-a", 6, 2, 128 << 20), range(4))
    first = {p: p.read_bytes() for p in parquet_files(tmp_path)}
    write_steps(ParquetSink(str(tmp_path), "run-a", 6, 2, 128 << 20), range(4, 6))
    files = parquet_files(tmp_path)
    assert [PARQUET_FILE.match(p.name)["seq"] for p in files] == ["00000", "00001", "00002"]
    assert all(p.read_bytes() == data for p, data in first.items())


def test_a_rank_killed_mid_write_leaves_every_parquet_file_readable(tmp_path):
    """SIGKILL while a rank writes row groups into its open file: the closed files read whole
    (pyarrow and DuckDB), the open one is a hidden .tmp that no *.parquet glob reads (and could
    not be read: it has no footer), and msmon db loads the rest and counts it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    script = ROOT / "tests" / "scripts" / "parquet_writer_killed.py"
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), "5"], env=env, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"open\n"
        time.sleep(0.2)  # writing row groups into the open file meanwhile
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    block = tmp_path / "parquet" / "run=killed-run" / "rank_block=0"
    files = parquet_files(tmp_path)
    (leftover,) = [block / n for n in os.listdir(block) if UNFINISHED_FILE.match(n)]
    assert [p.name for p in files] == ["part-00005-00000.parquet", "part-00005-00001.parquet"]
    assert [pq.read_table(p).num_rows for p in files] == [3 * 80, 3 * 80]
    assert leftover.stat().st_size > 1000  # row groups of steps 6 and 7 at least
    got = duckdb.connect().execute(
        "SELECT count(*), min(step), max(step) FROM read_parquet(?, hive_partitioning = true)",
        [str(tmp_path / "parquet" / "*" / "*" / "*.parquet")],
    )
    assert got.fetchone() == (6 * 80, 0, 5)
    with pytest.raises(pa.ArrowInvalid):  # what a reader would meet without the rename: no footer
        pq.read_table(leftover)
    from click.testing import CliRunner

    from msmon.launcher.cli import main

    result = CliRunner().invoke(main, ["db", "-d", str(tmp_path), "-o", str(tmp_path / "run.duckdb")])
    assert result.exit_code == 0, result.output
    assert "1 Parquet files not closed yet" in result.output
    con = duckdb.connect(str(tmp_path / "run.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM metrics").fetchone() == (6 * 80,)


def test_the_format_declares_pyarrow_and_a_missing_pyarrow_is_refused_before_training(monkeypatch, write_config):
    assert required_modules("parquet") == {"pyarrow": "msmon[parquet]"}
    assert required_modules("csv") == {}
    config = parse_config({"format": ["csv", "parquet"]})
    check_formats(config)  # installed here
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what Python does for a package that cannot be imported
    with pytest.raises(ConfigError, match=r"^cfg.json: format: 'parquet' needs pyarrow, which is not installed: "):
        check_formats(config, "cfg.json")
    with pytest.raises(ConfigError, match="pip install 'msmon\\[parquet\\]'"):
        TrainerMon(write_config({"format": ["parquet"]}))


def test_msmon_run_refuses_parquet_without_pyarrow_before_starting_the_job(tmp_path):
    """The launcher itself, in a process where pyarrow cannot be imported: one line, no job."""
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"format": ["parquet"], "wg_distribution": True}))
    out = tmp_path / "out"
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from msmon.launcher.cli import main\n"
        "sys.argv = ['msmon'] + sys.argv[1:]\n"
        "main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "run", "--config", str(config), "--output-dir", str(out), "--nproc-per-node", "2"]
        + ["--", str(ROOT / "tests" / "scripts" / "launcher_ddp.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "format: 'parquet' needs pyarrow, which is not installed" in lines[0], proc.stderr
    assert not out.exists()  # no rank started

"""`msmon db`: every rank's CSV, TensorBoard, anomaly dumps, summaries and configs in one DuckDB
database, checked against Python's own csv module and tensorboard's EventAccumulator; a re-run
adds only what is new."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import torch
from click.testing import CliRunner

from conftest import MLP, ROOT, rank_dir  # noqa: E402
from msmon import TrainerMon  # noqa: E402
from msmon.anomaly import dump as anomaly_dump  # noqa: E402
from msmon.launcher.cli import main  # noqa: E402
from msmon.offline.analyse.reading import read_dumps  # noqa: E402
from msmon.offline.analyse.verdict import order_events  # noqa: E402
from msmon.offline.results import db, scan, schema  # noqa: E402
from msmon.output.sinks.csv_sink import CsvSink  # noqa: E402
from msmon.output.sinks.tensorboard_sink import TensorBoardSink  # noqa: E402
from msmon.records import layout as output_names  # noqa: E402
from msmon.records.rows import RowKey, StepRecord  # noqa: E402
from msmon.stats.ops import OPS  # noqa: E402

GENERATOR = ROOT / "benchmarks" / "synthetic_output.py"
sys.path.insert(0, str(GENERATOR.parent))
from synthetic_output import OPS as SYNTHETIC_OPS  # noqa: E402  (the ops the synthetic run writes)


def make_synthetic(out: Path, ranks: int = 4, steps: int = 6, tensors: int = 20, window: int = 1) -> Path:
    """The benchmark's generator at test size: msmon's CSV layout, summaries, configs, dumps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(
        [
            sys.executable,
            str(GENERATOR),
            "-o",
            str(out),
            "--ranks",
            str(ranks),
            "--steps",
            str(steps),
            "--tensors",
            str(tensors),
            "--window",
            str(window),
            "--processes",
            "1",
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=120,
    )
    return out


def csv_values(root: Path) -> dict[tuple, float]:
    """Every value of every CSV file under root, read with Python's csv module: the reference."""
    out: dict[tuple, float] = {}
    for path in sorted(root.rglob("*.csv")):
        category = output_names.CSV_FILE.match(path.name)["category"]
        rank = int(scan.RANK_IN_DIR.search(path.parent.name)[1])
        with open(path, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                micro = int(row["micro_step"]) if row.get("micro_step") else None
                for op in OPS:
                    if op in row:
                        key = (rank, int(row["vpp_stage"]), category, row["name"], int(row["step"]), micro, op)
                        out[key] = float(row[op])
    return out


def db_values(database: str) -> dict[tuple, float]:
    con = duckdb.connect(database, read_only=True)
    try:
        rows = con.execute(
            "SELECT rank, vpp_stage, category, name, step, micro_step, op, value FROM metrics"
        ).fetchall()
    finally:
        con.close()
    out = {tuple(r[:7]): r[7] for r in rows}
    assert len(out) == len(rows), "a value is in the database twice"
    return out


def same(a: dict[tuple, float], b: dict[tuple, float]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        other = b[key]
        assert (math.isnan(value) and math.isnan(other)) or value == other, key


def test_every_csv_value_of_every_rank_is_one_row_of_the_long_table(tmp_path):
    out = make_synthetic(tmp_path / "out")
    database = str(tmp_path / "run.duckdb")
    report = db.load([str(out)], database, progress=False)
    reference = csv_values(out)
    assert len(reference) == 4 * 6 * 20 * len(SYNTHETIC_OPS)
    assert report.values == len(reference) and report.new == 4 * 5 * 6 + 4 * 3  # CSV + summary/config/dump per rank
    same(db_values(database), reference)


def test_a_rerun_with_nothing_new_adds_nothing_and_a_grown_csv_adds_only_its_new_rows(tmp_path):
    out = make_synthetic(tmp_path / "out", ranks=2, steps=3, tensors=10)
    database = str(tmp_path / "run.duckdb")
    first = db.load([str(out)], database, progress=False)
    again = db.load([str(out)], database, progress=False)
    assert (again.new, again.grown, again.reloaded, again.values) == (0, 0, 0, 0)
    assert again.unchanged == first.new
    grown = sorted(out.glob("*rank1-*/grad_reduced_2-2.csv"))[0]
    with open(grown, "a", encoding="utf-8") as fh:
        fh.write('0,"extra, with comma",2,1.5,-0.25,0.5,0.001,0.0,0.0,0.0\n')
        fh.write("0,torn.weight,2,1.0,-1")  # a line still being written
    third = db.load([str(out)], database, progress=False)
    assert (third.grown, third.new, third.values) == (1, 0, len(SYNTHETIC_OPS))
    values = db_values(database)
    assert values[(1, 0, "grad_reduced", "extra, with comma", 2, None, "norm")] == 1.5
    assert not any(k[3] == "torn.weight" for k in values), "a line without its newline waits for the next load"
    with open(grown, "a", encoding="utf-8") as fh:
        fh.write(".0,1.0,0.0,0.0,0.0,0.0\n")
    fourth = db.load([str(out)], database, progress=False)
    assert (fourth.grown, fourth.values) == (1, len(SYNTHETIC_OPS))
    same(db_values(database), csv_values(out))
    con = duckdb.connect(database, read_only=True)
    path, size, mtime, loaded, records = con.execute(
        "SELECT path, size, mtime_ns, loaded_bytes, records FROM files WHERE path = ?", [str(grown)]
    ).fetchone()
    con.close()
    st = os.stat(grown)
    assert (size, mtime, loaded, records) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_size,
        2 + 2,
    )  # 10 tensors over 5 categories, 2 lines added


def test_a_rewritten_csv_is_loaded_again_in_place_of_its_old_rows(tmp_path):
    out = make_synthetic(tmp_path / "out", ranks=1, steps=2, tensors=5)
    database = str(tmp_path / "run.duckdb")
    db.load([str(out)], database, progress=False)
    target = sorted(out.glob("*rank0-*/exp_avg_1-1.csv"))[0]
    target.write_text("vpp_stage,name,step,norm\n0,only.weight,1,7.0\n", encoding="utf-8")
    report = db.load([str(out)], database, progress=False)
    assert (report.reloaded, report.values) == (1, 1)
    same(db_values(database), csv_values(out))


def test_a_malformed_line_is_skipped_and_counted_and_a_foreign_csv_reported(tmp_path):
    out = make_synthetic(tmp_path / "out", ranks=1, steps=1, tensors=5)
    target = sorted(out.glob("*rank0-*/exp_avg_0-0.csv"))[0]
    with open(target, "a", encoding="utf-8") as fh:
        fh.write("0,bad.weight,zero,1,2,3,4,5,6,7\n")
    (target.parent / "notes_0-0.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    report = db.load([str(out)], str(tmp_path / "run.duckdb"), progress=False)
    assert report.skipped_lines == 1
    assert any("notes_0-0.csv: not msmon's CSV layout" in p for p in report.problems)
    values = db_values(str(tmp_path / "run.duckdb"))
    assert not any(k[3] == "bad.weight" for k in values) and len(values) == 5 * len(SYNTHETIC_OPS)


def _record(step: int, keys: list[RowKey], values: list[list[float]], histograms=()) -> StepRecord:
    return StepRecord(
        step=step,
        rank=3,
        ops=list(SYNTHETIC_OPS),  # msmon's seven: the rows' values below
        keys=keys,
        values=values,
        histograms=list(histograms),
        table=torch.tensor(values, dtype=torch.float64),
    )


def test_tensorboard_scalars_and_histograms_load_as_tensorboard_reads_them(tmp_path):
    """A TensorBoard-only rank directory, written by msmon's own sink; read back independently
    with tensorboard's EventAccumulator (every event kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rank = tmp_path / "out" / "Dec03_10-00-00-rank3-0000abcd"
    rank.mkdir(parents=True)
    sink = TensorBoardSink(str(rank))
    keys = [
        RowKey("actv", "fc1.output", 0, 0),
        RowKey("actv", "fc1.output", 0, 1),
        RowKey("grad_reduced", "fc1.weight", 1),
    ]
    edges = [-1.0, -0.5, 0.0, 0.5, 1.0]
    for step in range(3):
        values = [[(i + 1) * 0.1 + step + j * 0.01 for j in range(len(SYNTHETIC_OPS))] for i in range(len(keys))]
        values[0][0] = math.inf if step == 2 else values[0][0]
        sink.write(
            _record(step, keys, values, [("1:fc1.weight/rank3/update_hist", edges, [1.0, 2.0, 3.0, float(step)])])
        )
    sink.close()
    database = str(tmp_path / "run.duckdb")
    report = db.load([str(tmp_path / "out")], database, progress=False)
    assert report.values == 3 * len(keys) * len(SYNTHETIC_OPS) and report.histograms == 3
    acc = EventAccumulator(str(rank), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    con = duckdb.connect(database, read_only=True)
    got = {
        (r[0], r[1], r[2], r[3], r[4], r[5], r[6]): r[7]
        for r in con.execute(
            "SELECT rank, vpp_stage, category, name, step, micro_step, op, value FROM metrics"
        ).fetchall()
    }
    want = {}
    for tag in acc.Tags()["scalars"]:
        head, _, task = tag.rpartition("/rank3/")
        category, _, op = task.rpartition("_")
        vpp, _, rest = head.partition(":")
        name, _, micro = rest.rpartition(":") if rest.count(":") else (rest, "", "")
        for event in acc.Scalars(tag):
            want[(3, int(vpp), category, name, event.step, int(micro) if micro else None, op)] = event.value
    assert got == want
    assert con.execute("SELECT category, vpp_stage, name, position FROM tensors ORDER BY ALL").fetchall() == [
        ("actv", 0, "fc1.output", 0),
        ("grad_reduced", 1, "fc1.weight", 0),
        ("update", 1, "fc1.weight", 0),
    ]
    hist = con.execute(
        "SELECT rank, vpp_stage, category, name, step, edges, counts FROM histograms ORDER BY step"
    ).fetchall()
    events = acc.Histograms("1:fc1.weight/rank3/update_hist")
    assert [(h[0], h[1], h[2], h[3], h[4]) for h in hist] == [(3, 1, "update", "fc1.weight", s) for s in range(3)]
    for row, event in zip(hist, events):
        assert row[5] == [event.histogram_value.min, *event.histogram_value.bucket_limit]
        assert row[6] == list(event.histogram_value.bucket)
    con.close()


def test_a_real_run_loads_csv_once_and_leaves_out_its_tensorboard_duplicates(write_config, output_dir, tmp_path):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon(
        write_config(
            {
                "wg_distribution": True,
                "xy_distribution": True,
                "mv_distribution": True,
                "ur_distribution": True,
                "format": ["csv", "tensorboard"],
                "ops": list(OPS),
            }
        ),
        params_have_main_grad=False,
    )
    mon.set_monitor(model, optimizer)
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    database = str(tmp_path / "run.duckdb")
    report = db.load([str(output_dir)], database, progress=False)
    reference = csv_values(output_dir)
    same(db_values(database), reference)
    assert report.tb_duplicates == len(reference), "every TensorBoard scalar is a CSV value already"
    con = duckdb.connect(database, read_only=True)
    assert con.execute("SELECT count(*) FROM histograms").fetchone()[0] > 0
    summary = json.loads((rank_dir(output_dir) / "summary.json").read_text())
    row = con.execute("SELECT rank, steps_recorded, monitor_cost_pct, summary FROM summaries").fetchone()
    assert row[:3] == (0, summary["steps_recorded"], summary["monitor_cost_pct"]) and json.loads(row[3]) == summary
    formats, ops = con.execute("SELECT format, ops FROM configs").fetchone()
    assert formats == "csv,tensorboard" and ops == ",".join(OPS)
    con.close()


def test_anomalies_are_in_msmon_analyse_training_order(tmp_path):
    out = make_synthetic(tmp_path / "out", ranks=4, steps=10, tensors=20)
    database = str(tmp_path / "run.duckdb")
    report = db.load([str(out)], database, progress=False)
    ordered = order_events(read_dumps(str(out / anomaly_dump.DUMP_DIR)).events)
    assert report.anomalies == len(ordered) > 0
    con = duckdb.connect(database, read_only=True)
    rows = con.execute(
        "SELECT rank, step, micro_step, stage, call_id, name, category, rule FROM anomaly_timeline"
    ).fetchall()
    con.close()
    assert rows == [(e.rank, e.step, e.micro_step, e.stage, e.call_id, e.name, e.category, e.rule) for e in ordered]
    # a dump that grows rebuilds the table, still in training order
    writer = anomaly_dump.AnomalyDumpWriter(str(out), 0, 0, [0, 1, 2, 3])
    writer.append(
        [
            {
                "step": 0,
                "stage": "forward",
                "name": "layers.0.attn.qkv.output",
                "category": "actv",
                "micro_step": 0,
                "op": "norm",
                "value": 1e9,
                "rule": "AnomalyTurbulence",
                "call_id": 0,
            }
        ]
    )
    again = db.load([str(out)], database, progress=False)
    assert again.anomalies == len(ordered) + 1
    con = duckdb.connect(database, read_only=True)
    first = con.execute("SELECT rank, step, value FROM anomaly_timeline LIMIT 1").fetchone()
    con.close()
    assert first == (0, 0, 1e9)


def test_the_documented_python_query_works(tmp_path):
    """The README's example, verbatim in spirit: plain duckdb, no msmon import."""
    out = make_synthetic(tmp_path / "out", ranks=2, steps=4, tensors=10)
    database = str(tmp_path / "run.duckdb")
    result = CliRunner().invoke(main, ["db", "-d", str(out), "-o", database, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "new" in result.output and database in result.output
    code = (
        "import duckdb, json\n"
        f"con = duckdb.connect({database!r}, read_only=True)\n"
        "print(json.dumps(con.sql(\"SELECT rank, step, value FROM metrics WHERE category = 'grad_reduced' "
        "AND op = 'norm' AND name = 'layers.0.attn.qkv.weight' ORDER BY rank, step\").fetchall()))\n"
        "print(con.sql('SELECT count(*) FROM metrics_wide').fetchall()[0][0])\n"
        "print(con.sql('SELECT count(*) FROM rank_spread').fetchall()[0][0] > 0)\n"
        "print(json.dumps(con.sql('SELECT rank, monitor_cost_pct FROM monitor_cost').fetchall()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = proc.stdout.splitlines()
    assert len(json.loads(lines[0])) == 2 * 4 and int(lines[1]) == 2 * 4 * 10 and lines[2] == "True"
    assert [r[0] for r in json.loads(lines[3])] == [0, 1]


def test_msmon_db_says_what_is_wrong_with_a_missing_directory(tmp_path):
    result = CliRunner().invoke(main, ["db", "-d", str(tmp_path / "nothing"), "-o", str(tmp_path / "x.duckdb")])
    assert result.exit_code == 1 and "is not a directory" in result.output


def test_msmon_db_and_report_on_a_folder_without_msmon_output_fail_in_one_line_and_write_nothing(tmp_path):
    folder = tmp_path / "not_output"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "notes.txt").write_text("no monitor output here")
    for argv, written in (
        (["db", "-d", str(folder), "-o", str(tmp_path / "x.duckdb")], tmp_path / "x.duckdb"),
        (["report", "-d", str(folder), "-o", str(tmp_path / "x.html")], tmp_path / "x.html"),
    ):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 1, argv
        (line,) = result.output.splitlines()
        assert line == (
            f"Error: no msmon output in {folder}: no CSV, TensorBoard events, summary.json, config.json or anomaly "
            "dump; give the folder the run wrote to ($MONITOR_OUTPUT_DIR, default monitor_output)"
        )
        assert not written.exists()


def test_the_torch_free_readers_use_the_writers_names():
    assert schema.OPS is OPS
    assert (scan.DUMP_FILE, scan.MSPROBE_DUMP_FILE) == (output_names.DUMP_FILE, output_names.MSPROBE_DUMP_FILE)
    assert anomaly_dump.dump_path("out", 3) == os.path.join("out", output_names.DUMP_DIR, "rank3", scan.DUMP_FILE)


def test_one_database_holds_several_windows_and_a_csv_written_by_msmon_sink(tmp_path):
    """CsvSink's own output (window of 10 steps, micro-steps, a quoted name, non-finite values)."""
    rank = tmp_path / "out" / "Dec03_10-00-00-rank2-0000abcd"
    rank.mkdir(parents=True)
    sink = CsvSink(str(rank), ndigits=6, step_count_per_record=10)
    keys = [RowKey("actv", "blocks.0, odd", 1, 0), RowKey("actv", "blocks.1", 0, None)]
    for step in (8, 9, 10):
        sink.write(
            _record(
                step,
                keys,
                [[1.0 * step, math.nan, math.inf, -math.inf, 0.0, 0.5, 2.0], [0.25, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]],
            )
        )
    sink.close()
    database = str(tmp_path / "run.duckdb")
    db.load([str(tmp_path / "out")], database, progress=False)
    got = db_values(database)
    same(got, csv_values(tmp_path / "out"))
    assert got[(2, 1, "actv", "blocks.0, odd", 10, 0, "norm")] == 10.0
    assert got[(2, 0, "actv", "blocks.1", 9, None, "infs")] == 6.0
    assert math.isinf(got[(2, 1, "actv", "blocks.0, odd", 9, 0, "mean")])


def test_a_directory_given_twice_or_inside_another_is_loaded_once(tmp_path):
    out = make_synthetic(tmp_path / "out", ranks=1, steps=2, tensors=5)
    inner = sorted(out.glob("*-rank0-*"))[0]
    database = str(tmp_path / "run.duckdb")
    report = db.load([str(out), str(inner), str(out)], database, progress=False)
    assert report.values == 2 * 5 * len(SYNTHETIC_OPS)
    same(db_values(database), csv_values(out))

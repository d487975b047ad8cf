"""What the writers and the offline readers share is declared once: the anomaly record's fields
(anomaly/event.py) and the CSV file name (records/layout.py). What one side writes, every reader
parses the same way."""

from __future__ import annotations

import json
import math
import os

import duckdb

from msmon.anomaly import dump as anomaly_dump  # noqa: E402
from msmon.anomaly.event import FIELDS  # noqa: E402
from msmon.offline.convert.csv_to_tb import read_csv_steps  # noqa: E402
from msmon.offline.convert.sources import no_progress  # noqa: E402
from msmon.offline.results import db, scan  # noqa: E402
from msmon.output.resume import csv_windows  # noqa: E402
from msmon.output.sinks.csv_sink import CsvSink  # noqa: E402
from msmon.records import layout as output_names  # noqa: E402
from msmon.records.rows import RowKey, StepRecord  # noqa: E402


def test_every_field_of_a_dump_record_is_the_anomalies_column_of_its_name_in_the_records_order(tmp_path):
    out = tmp_path / "out"
    writer = anomaly_dump.AnomalyDumpWriter(str(out), 2, 1, [0, 2])
    key = RowKey("grad_reduced", "fc1.weight", 1)
    writer.append(
        [
            {
                "step": 7,
                "stage": "optimizer",
                "name": key.name,
                "category": key.category,
                "vpp_stage": 1,
                "call_id": 4,
                "op": "norm",
                "value": float("inf"),
                "history": 0.5,
                "rule": "AnomalyNan",
                "message": "norm=inf",
            }
        ]
    )
    with open(writer.path, encoding="utf-8") as fh:
        (line,) = fh.read().splitlines()
    record = json.loads(line)
    assert tuple(record) == FIELDS  # the dump writes the record's fields, in their declared order
    database = str(tmp_path / "run.duckdb")
    db.load([str(out)], database, progress=False)
    con = duckdb.connect(database, read_only=True)
    columns = [row[0] for row in con.execute("DESCRIBE anomalies").fetchall()]
    row = con.execute(f"SELECT {', '.join(FIELDS)} FROM anomalies").fetchone()
    con.close()
    assert columns == ["seq", *FIELDS, "description", "file"]
    stored = dict(zip(FIELDS, row))
    assert stored == {**record, "value": math.inf}
    assert stored["tag"] == key.tag(2) == "1:fc1.weight/rank2/grad_reduced"


def test_the_csv_sinks_file_names_are_read_back_alike_by_append_output_msmon_db_and_convert(tmp_path):
    """One format and one pattern (records/layout.py): a window file and the `_from{step}` file
    begun when a category's columns change mid-window parse the same way everywhere."""
    rank = tmp_path / "out" / "Dec03_10-00-00-rank3-0000abcd"
    rank.mkdir(parents=True)
    sink = CsvSink(str(rank), ndigits=6, step_count_per_record=4)
    key = RowKey("grad_reduced", "fc1.weight")
    sink.write(StepRecord(step=0, rank=3, ops=["norm"], keys=[key], values=[[1.0]]))
    sink.write(StepRecord(step=1, rank=3, ops=["norm", "max"], keys=[key], values=[[2.0, 3.0]]))
    sink.write(StepRecord(step=5, rank=3, ops=["norm", "max"], keys=[key], values=[[4.0, 5.0]]))
    sink.close()
    names = sorted(p.name for p in rank.iterdir())
    assert names == ["grad_reduced_0-3.csv", "grad_reduced_0-3_from1.csv", "grad_reduced_4-7.csv"]
    expected = {
        "grad_reduced_0-3.csv": ("grad_reduced", "0", "3", None),
        "grad_reduced_0-3_from1.csv": ("grad_reduced", "0", "3", "1"),
        "grad_reduced_4-7.csv": ("grad_reduced", "4", "7", None),
    }
    for name, (category, first, last, start) in expected.items():
        assert output_names.csv_file_name(category, int(first), int(last), start and int(start)) == name
    windows = {os.path.basename(p): (m["category"], m["first"], m["last"], m["start"]) for p, m in csv_windows(rank)}
    assert windows == expected
    assert {name: scan.classify(name) for name in names} == {name: (scan.CSV, "grad_reduced") for name in names}
    read_back = {}
    for name in names:
        read_back[name] = [
            (step, [(r.name, cells) for r, cells in rows])
            for step, rows in read_csv_steps(str(rank / name), no_progress())
        ]
    assert read_back == {
        "grad_reduced_0-3.csv": [(0, [("fc1.weight", [("norm", 1.0)])])],
        "grad_reduced_0-3_from1.csv": [(1, [("fc1.weight", [("norm", 2.0), ("max", 3.0)])])],
        "grad_reduced_4-7.csv": [(5, [("fc1.weight", [("norm", 4.0), ("max", 5.0)])])],
    }


def test_a_rank_directory_name_is_written_and_parsed_back_by_output_layout_alone():
    from datetime import datetime

    from msmon.config.time_range import TIME_FORMAT
    from msmon.records import layout

    name = layout.rank_dir_name(13)
    match = layout.RANK_DIR.match(name)
    assert match is not None and int(match["rank"]) == 13
    datetime.strptime(match["time"], TIME_FORMAT)  # the time prefix parses with the config's format
    assert name != layout.rank_dir_name(13)  # a fresh uid each time: two monitors of a rank never share one

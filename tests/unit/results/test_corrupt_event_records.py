"""One corrupt record in a real TensorBoard events file written by msmon: `msmon db` and
`msmon convert tb2csv` skip that record, keep every other one, and say so."""

from __future__ import annotations

import csv
import logging
import struct
from pathlib import Path

import duckdb
import pytest
import torch

from conftest import MLP, rank_dir  # noqa: E402
from msmon import TrainerMon  # noqa: E402
from msmon.offline.convert.sources import RankSource  # noqa: E402
from msmon.offline.convert.tb_to_csv import tensorboard_to_csv  # noqa: E402
from msmon.offline.results import db  # noqa: E402

OPS = ["norm", "max"]
CORRUPT_STEP = 2


def tensorboard_run(write_config, output_dir) -> Path:
    """Five monitored steps written to TensorBoard only; the events file's path."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"wg_distribution": True, "param_distribution": True, "format": ["tensorboard"], "ops": OPS}
    mon = TrainerMon(write_config(config), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    for _ in range(5):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    (events,) = rank_dir(output_dir).glob("*tfevents*")
    return events


def records(data: bytes) -> list[tuple[int, int]]:
    """(offset, data length) of each TFRecord: uint64 length, uint32 CRC, data, uint32 CRC."""
    out, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        out.append((pos, length))
        pos += 12 + length + 4
    return out


def corrupt_one_record(path: Path, where: str) -> dict[tuple[str, str, int, str], float]:
    """Breaks the checksum of the first record of step CORRUPT_STEP holding values (its data, or
    its length field); returns every scalar of the other records, read with protobuf alone:
    {(category, name, step, op): value}."""
    from tensorboard.compat.proto.event_pb2 import Event

    data = bytearray(path.read_bytes())
    expected: dict[tuple[str, str, int, str], float] = {}
    broken = None
    for offset, length in records(bytes(data)):
        event = Event.FromString(bytes(data[offset + 12 : offset + 12 + length]))
        if broken is None and event.step == CORRUPT_STEP and event.summary.value:
            broken = offset, length
            continue
        for value in event.summary.value:
            head, _, task = value.tag.rpartition("/rank0/")
            category, _, op = task.rpartition("_")
            expected[(category, head.split(":", 1)[1], event.step, op)] = value.simple_value
    assert broken is not None
    offset, length = broken
    if where == "data":
        data[offset + 12 + length // 2] ^= 0xFF
    else:
        data[offset + 3] ^= 0x01  # the length field: the header's checksum fails, the length is wrong
    path.write_bytes(bytes(data))
    return expected


@pytest.mark.parametrize("where", ["data", "length"])
def test_msmon_db_skips_a_corrupt_event_record_keeps_the_rest_of_the_file_and_says_so(
    write_config, output_dir, tmp_path, where
):
    expected = corrupt_one_record(tensorboard_run(write_config, output_dir), where)
    assert {step for _, _, step, _ in expected} == {0, 1, 3, 4}  # one event per step: its record holds them all
    report = db.load([str(output_dir)], str(tmp_path / "run.duckdb"), progress=False)
    con = duckdb.connect(str(tmp_path / "run.duckdb"), read_only=True)
    got = {
        (category, name, step, op): value
        for category, name, step, op, value in con.execute(
            "SELECT category, name, step, op, value FROM metrics"
        ).fetchall()
    }
    con.close()
    assert got == pytest.approx(expected)
    assert [line for line in report.lines() if "corrupt record(s) skipped" in line] == [
        f"msmon db: {next(output_dir.rglob('*tfevents*'))}: 1 corrupt record(s) skipped (checksum mismatch); "
        "the rest of the file was loaded"
    ]


@pytest.mark.parametrize("where", ["data", "length"])
def test_tb2csv_skips_a_corrupt_event_record_keeps_the_rest_of_the_file_and_says_so(
    write_config, output_dir, tmp_path, where, caplog
):
    events = tensorboard_run(write_config, output_dir)
    expected = corrupt_one_record(events, where)
    source = rank_dir(output_dir)
    with caplog.at_level(logging.WARNING, logger="msmon"):
        tensorboard_to_csv(RankSource(0, str(source), source.name), str(tmp_path / "csv"))
    got = {}
    for path in (tmp_path / "csv" / source.name).glob("*.csv"):
        category = path.name.rsplit("_", 1)[0]
        with open(path, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                for op in OPS:
                    got[(category, row["name"], int(row["step"]), op)] = float(row[op])
    assert got == pytest.approx(expected, rel=0, abs=1e-6)  # the CSV rounds to 6 digits
    assert [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()] == [
        f"msmon: {events}: 1 corrupt record(s) skipped (checksum mismatch); the rest was read"
    ]

"""What the live sinks write reads back from TensorBoard as it reads from the CSV: module names that
hold `/` (even `/rank{n}`) in the by_rank layout, and the categories with columns of their own
(grad_agreement's `norm_ratio`, the loss, an L2 feature), through `msmon convert tb2csv` and
`msmon db`. Each rank directory is written by the real writer thread with both real sinks, and
its events are read by tensorboard's reader (tb2csv) and by msmon db's."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from msmon.launcher.cli import main
from msmon.output.sinks.csv_sink import CsvSink
from msmon.output.sinks.tensorboard_sink import TensorBoardSink
from msmon.output.writer import BackgroundWriter
from msmon.records.rows import RowKey
from msmon.runtime.transfer import HostBatch

RANK = 1
SLASHED = [  # names a ModuleDict key (no `.` allowed, `/` is) gives a module
    RowKey("grad_reduced", "enc/layer.0.weight"),
    RowKey("grad_reduced", "shard/rank1"),  # ends like the rank component of the default layout
    RowKey("grad_reduced", "a/rank1/b.weight"),
    RowKey("actv", "enc/layer.0.output", micro_step=0),
]
OWN_COLUMNS = [
    RowKey("grad_reduced", "fc.weight"),
    RowKey("grad_agreement", "fc.weight", op="cos"),
    RowKey("grad_agreement", "fc.weight", op="norm_ratio"),
    RowKey("loss", "loss", micro_step=0, op="value"),
    RowKey("attention_hook", "attn", op="entropy"),
    RowKey("attention_hook", "attn", op="softmax_max"),
]


def write_rank(out: Path, keys: list[RowKey], by_rank: bool, steps: int = 3) -> Path:
    directory = out / f"Dec01_10-00-00-rank{RANK}-abcdef01"
    directory.mkdir(parents=True)
    sinks = [CsvSink(str(directory), 8, 1), TensorBoardSink(str(directory), by_rank=by_rank)]
    writer = BackgroundWriter(sinks, rank=RANK)
    try:
        for step in range(steps):
            values = torch.tensor(
                [[0.5 + i + step / 8, float(i), 2.0 + i] for i in range(len(keys))], dtype=torch.float64
            )
            writer.submit(step, ["norm", "min", "max"], HostBatch(keys=keys, values=values))
        writer.drain()
    finally:
        writer.close()
    return directory


def csv_rows(directory: Path) -> dict[str, list[list[str]]]:
    files = {}
    for path in sorted(directory.glob("*.csv")):
        with open(path, newline="") as fh:
            files[path.name] = list(csv.reader(fh))
    return files


def assert_same_csv(back: dict[str, list[list[str]]], live: dict[str, list[list[str]]]) -> None:
    assert set(back) == set(live)
    for name, rows in live.items():
        assert back[name][0] == rows[0], name  # the header: the category's own columns
        assert [r[:4] for r in back[name]] == [r[:4] for r in rows], name  # names, steps, micro-steps
        for got, want in zip(back[name][1:], rows[1:]):
            numbers = len(rows[0]) - (4 if "micro_step" in rows[0] else 3)
            assert [float(x) for x in got[-numbers:]] == pytest.approx([float(x) for x in want[-numbers:]], rel=1e-6)


def tb2csv(out: Path, back: Path) -> dict[str, list[list[str]]]:
    result = CliRunner().invoke(main, ["convert", "tb2csv", "-d", str(out), "-o", str(back)])
    assert result.exit_code == 0, result.output
    (converted,) = back.iterdir()
    return csv_rows(converted)


def test_by_rank_names_holding_a_slash_read_back_from_tensorboard_as_in_the_csv(tmp_path):
    directory = write_rank(tmp_path / "out", SLASHED, by_rank=True)
    assert_same_csv(tb2csv(tmp_path / "out", tmp_path / "back"), csv_rows(directory))

    import duckdb

    events = tmp_path / "events" / directory.name  # the events alone: the CSV would be loaded instead
    events.mkdir(parents=True)
    for path in directory.glob("events.out.tfevents.*"):
        shutil.copy(path, events)
    database = tmp_path / "run.duckdb"
    result = CliRunner().invoke(main, ["db", "-d", str(tmp_path / "events"), "-o", str(database), "--no-progress"])
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(database), read_only=True)
    loaded = con.execute("SELECT DISTINCT rank, category, name, micro_step FROM metrics ORDER BY 2, 3").fetchall()
    con.close()
    assert loaded == sorted(
        [(RANK, k.category, k.name, k.micro_step) for k in SLASHED], key=lambda row: (row[1], row[2])
    )


def test_the_default_layout_keeps_reading_names_that_hold_a_slash(tmp_path):
    directory = write_rank(tmp_path / "out", SLASHED, by_rank=False)
    assert_same_csv(tb2csv(tmp_path / "out", tmp_path / "back"), csv_rows(directory))


@pytest.mark.parametrize("by_rank", [False, True], ids=["default", "by_rank"])
def test_categories_with_their_own_columns_read_back_with_their_columns(tmp_path, by_rank):
    directory = write_rank(tmp_path / "out", OWN_COLUMNS, by_rank=by_rank)
    live = csv_rows(directory)
    assert live["grad_agreement_0-0.csv"][0] == ["vpp_stage", "name", "step", "cos", "norm_ratio"]
    back = tb2csv(tmp_path / "out", tmp_path / "back")
    assert not any(name.startswith("grad_agreement_norm") for name in back)  # not a category of its own
    assert_same_csv(back, live)

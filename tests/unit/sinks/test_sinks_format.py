"""The CSV sink writes each value as repr(csv_value(value, ndigits)): msprobe's round(value,
ndigits) for magnitudes of 1 or more, ndigits significant digits below 1 (no non-zero value
reads 0), however the step's values are formatted; the step buffer keeps rows in the order
they were added."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from conftest import MLP, rank_dir, read_csv_rows, reference_stats
from msmon import TrainerMon
from msmon.output.sinks.api_sink import ApiSink
from msmon.output.sinks.csv_sink import CsvSink
from msmon.output.sinks.numbers import csv_table, csv_values
from msmon.records.csv_cell import csv_value
from msmon.records.rows import RowKey, StepRecord
from msmon.runtime.buffer import StepBuffer
from msmon.stats import native

EDGE_VALUES = [
    0.0,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    1e-300,
    5e-324,
    1.5e300,
    0.1234565,
    2.5e-7,
    -46.9906395,
    123456789.123456789,
    1e-05,
    0.3,
]


def _record(values: list[list[float]], keys: list[RowKey], with_table: bool) -> StepRecord:
    table = torch.tensor(values, dtype=torch.float64) if with_table else None
    return StepRecord(step=7, rank=0, ops=["a", "b"], keys=keys, values=values, table=table)


def _read(path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


@pytest.mark.parametrize(
    "value, cell",
    [
        (1e-12, "1e-12"),
        (3.2e-7, "3.2e-07"),
        (0.000123456, "0.000123456"),
        (0.0001234567, "0.000123457"),
        (0.5, "0.5"),
        (0.1234565, repr(round(0.1234565, 6))),
        (12.345678, "12.345678"),
        (12.3456789, "12.345679"),
        (0.0, "0.0"),
        (-0.0, "-0.0"),
        (-1e-9, "-1e-09"),
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (5e-324, "5e-324"),
        (0.9999996, "1.0"),
        (-46.9906395, "-46.99064"),
    ],
)
def test_csv_value_keeps_significant_digits_below_one_and_msprobe_rounding_above(value, cell):
    assert repr(csv_value(value, 6)) == cell


def test_csv_cells_are_python_rounded_at_one_and_above_and_never_zero_below(tmp_path):
    gen = torch.Generator().manual_seed(3)
    randoms = (
        torch.randn(4000, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-15, 9, (4000,), generator=gen)
    ).tolist()
    flat = EDGE_VALUES + randoms
    flat += [0.0] * (len(flat) % 2)
    values = [flat[i : i + 2] for i in range(0, len(flat), 2)]
    keys = [RowKey("grad_reduced", f"layer{i}.weight") for i in range(len(values))]
    for with_table, sub in ((True, "table"), (False, "lists")):
        directory = tmp_path / sub
        directory.mkdir()
        sink = CsvSink(str(directory), ndigits=6, step_count_per_record=1)
        sink.write(_record(values, keys, with_table))
        sink.close()
        rows = _read(directory / "grad_reduced_7-7.csv")
        assert rows[0] == ["vpp_stage", "name", "step", "a", "b"]
        assert len(rows) == len(values) + 1
        for row, key, want in zip(rows[1:], keys, values):
            assert row[:3] == ["0", key.name, "7"]
            for cell, v in zip(row[3:], want):
                if not abs(v) < 1.0 or v == 0.0:  # msprobe's format, unchanged
                    assert cell == repr(round(v, 6))
                else:  # six significant digits, checked against the value itself
                    assert float(cell) != 0.0 and cell == repr(float(f"{v:.6g}"))
                    assert abs(float(cell) - v) <= 5e-6 * abs(v)


def test_csv_micro_step_column_and_quoted_names(tmp_path):
    keys = [RowKey("actv", "blocks.0, odd", 1, 2), RowKey("actv", "blocks.1", 0, None)]
    sink = CsvSink(str(tmp_path), ndigits=3, step_count_per_record=10)
    sink.write(_record([[1.23456, 2.0], [3.0, math.nan]], keys, True))
    sink.write(
        StepRecord(
            step=8,
            rank=0,
            ops=["a", "b"],
            keys=keys[:1],
            values=[[0.5, 0.25]],
            table=torch.tensor([[0.5, 0.25]], dtype=torch.float64),
        )
    )
    sink.close()
    rows = _read(tmp_path / "actv_0-9.csv")
    assert rows == [
        ["vpp_stage", "name", "step", "micro_step", "a", "b"],
        ["1", "blocks.0, odd", "7", "2", "1.235", "2.0"],
        ["0", "blocks.1", "7", "", "3.0", "nan"],
        ["1", "blocks.0, odd", "8", "2", "0.5", "0.25"],
    ]


def test_api_sink_gives_each_category_of_the_latest_record_holding_it():
    sink = ApiSink()
    grads = [RowKey("grad_reduced", "w"), RowKey("actv", "m.output", 0, 0)]
    sink.write(StepRecord(step=1, rank=2, ops=["norm"], keys=grads, values=[[1.0], [2.0]]))
    sink.write(StepRecord(step=2, rank=2, ops=["norm"], keys=grads[:1], values=[[3.0]]))
    assert sink.metrics("grad_reduced") == {"0:w/rank2/grad_reduced": {"norm": 3.0}}
    assert sink.metrics("actv") == {"0:m.output:0/rank2/actv": {"norm": 2.0}}
    assert sink.metrics("exp_avg") == {} and sink.last_step == 2


def test_step_buffer_keeps_single_and_batched_rows_in_the_order_added():
    buffer = StepBuffer()
    keys = [RowKey("actv", f"m{i}") for i in range(6)]
    buffer.add(keys[0], torch.tensor([0.0, 0.5]))
    buffer.add(keys[1], torch.tensor([1.0, 1.5]))
    buffer.add_many(keys[2:4], torch.tensor([[2.0, 2.5], [3.0, 3.5]]))
    buffer.add(keys[4], torch.tensor([4.0, 4.5]))
    buffer.add(keys[5], torch.tensor([5.0, 5.5]))
    taken_keys, chunks, _, _, _ = buffer.take()
    assert taken_keys == keys
    assert torch.cat(chunks).tolist() == [[i, i + 0.5] for i in range(6)]
    assert len(buffer) == 0 and buffer.take()[1] == []


@pytest.fixture(params=["kernel", "torch"])
def rounding_path(request, monkeypatch):
    """csv_flat on the native kernel (a C++ compiler is a test requirement) or on torch ops."""
    monkeypatch.setenv(native.ENV, "1" if request.param == "kernel" else "0")
    native.reset()
    if request.param == "kernel" and native.load() is None:
        pytest.fail("the native kernel did not build")
    yield request.param
    monkeypatch.delenv(native.ENV)
    native.reset()


def test_vectorised_formatting_equals_csv_value_near_ties_and_at_every_scale(rounding_path):
    gen = torch.Generator().manual_seed(11)
    table = torch.randn(5000, 4, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -30, 18, (5000, 4), generator=gen
    )
    ties = torch.tensor([k / 128 for k in range(-256, 256)], dtype=torch.float64)  # exact decimal ties at 6 digits
    near = torch.nextafter(ties, torch.full_like(ties, math.inf))
    powers = torch.tensor(
        [10.0**-k for k in range(1, 40)] + [-(10.0**-k) for k in range(1, 40)], dtype=torch.float64
    )  # where log10 may misjudge the first digit
    powers = torch.cat([powers, torch.nextafter(powers, torch.zeros_like(powers)), torch.nextafter(powers, powers * 2)])
    table = torch.cat(
        [
            table.flatten(),
            ties,
            ties / 1000,
            near,
            near / 1000,
            powers,
            torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 0.9999996, 0.99999949999]),
        ]
    )
    table = table.view(-1, 1)
    assert (native.csv_rounding() is not None) == (rounding_path == "kernel")
    for ndigits in (0, 1, 2, 6, 9, 15, 17, 25):
        expected = [repr(csv_value(v, ndigits)) for v in table.flatten().tolist()]  # repr: NaN equals itself
        assert [repr(row[0]) for row in csv_values(table, ndigits)] == expected
        assert [repr(v) for v in csv_table(table, ndigits).view(-1).tolist()] == expected  # the Parquet sink's


def test_adams_small_exp_avg_sq_never_reads_zero_in_csv_or_tensorboard(write_config, output_dir):
    """A small loss scale gives second moments of 1e-9..1e-15: msprobe's 6 decimals wrote them
    all as 0.0. Every cell now reads as the independently computed statistic, to 6 digits."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ops = ["norm", "min", "max", "mean"]
    monitor = TrainerMon(write_config({"mv_distribution": True, "format": ["csv", "tensorboard"], "ops": ops}))
    monitor.set_monitor(model, optimizer, grad_acc_steps=1)
    expected = {}
    for step in range(3):
        (1e-4 * model(torch.randn(5, 8)).square().mean()).backward()
        optimizer.step()
        for name, p in model.named_parameters():
            expected[step, name] = reference_stats(optimizer.state[p]["exp_avg_sq"], ops)
        optimizer.zero_grad()
    monitor.close()
    out = rank_dir(output_dir)
    rows = read_csv_rows(out, "exp_avg_sq")
    assert len(rows) == len(expected)
    tiny = 0
    for row in rows:
        for op, value in expected[int(row["step"]), row["name"]].items():
            got = float(row[op])
            assert (got == 0.0) == (value == 0.0), (row, op, value)
            assert got == pytest.approx(value, rel=1e-5, abs=0.0), (row, op, value)
            tiny += 0.0 < value < 5e-7  # what round(value, 6) wrote as 0.0
    assert tiny >= len(rows) * 3  # most cells would have read 0
    events = EventAccumulator(str(out), size_guidance={"scalars": 0})
    events.Reload()
    for (step, name), stats in expected.items():
        for op, value in stats.items():
            (event,) = [e for e in events.Scalars(f"0:{name}/rank0/exp_avg_sq_{op}") if e.step == step]
            assert event.value == pytest.approx(value, rel=1e-5, abs=0.0)  # float32 keeps 1e-15 as it is


def test_tensorboard_records_carry_the_checksums_tensorboard_computes_and_read_back(tmp_path):
    """msmon frames records with a C CRC32C; tensorboard's own (pure Python) checksum and
    its reader must agree with every byte."""
    import os
    import struct

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from msmon.output.sinks.tensorboard_sink import TensorBoardSink
    from msmon.records.rows import RowKey, StepRecord
    from msmon.records.tfrecord import masked_crc32c_function

    crc = masked_crc32c_function()
    for n in (0, 1, 7, 8, 9, 63, 4097, 250_000):
        data = os.urandom(n)
        assert crc(data) == masked_crc32c(data)
    sink = TensorBoardSink(str(tmp_path))
    keys = [RowKey("grad_reduced", f"layer{i}.weight") for i in range(300)]
    for step in range(3):
        sink.write(
            StepRecord(
                step=step,
                rank=0,
                ops=["norm", "max"],
                keys=keys,
                values=[[i + step * 0.5, -i * 1e-7] for i in range(300)],
            )
        )
    sink.close()
    raw = open(sink.path, "rb").read()
    offset, records = 0, 0
    while offset < len(raw):  # every record's two checksums, recomputed by tensorboard's function
        header = raw[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[offset + 8 : offset + 12])[0] == masked_crc32c(header)
        data = raw[offset + 12 : offset + 12 + length]
        assert struct.unpack("<I", raw[offset + 12 + length : offset + 16 + length])[0] == masked_crc32c(data)
        offset += 16 + length
        records += 1
    assert records == 4  # the file header and three steps
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    values = acc.Scalars("0:layer299.weight/rank0/grad_reduced_norm")
    assert [(v.step, v.value) for v in values] == [(0, 299.0), (1, 299.5), (2, 300.0)]

"""The CSV sink writes each value as repr(round(value, ndigits)), however the step's values are
rounded, and the step buffer keeps rows in the order they were added."""
from __future__ import annotations

import csv
import math

import torch

from msmon.records import RowKey, StepBuffer, StepRecord
from msmon.sinks.api_sink import ApiSink
from msmon.sinks.csv_sink import CsvSink

EDGE_VALUES = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-300, 5e-324, 1.5e300, 0.1234565, 2.5e-7,
               -46.9906395, 123456789.123456789, 1e-05, 0.3]


def _record(values: list[list[float]], keys: list[RowKey], with_table: bool) -> StepRecord:
    table = torch.tensor(values, dtype=torch.float64) if with_table else None
    return StepRecord(step=7, rank=0, ops=["a", "b"], keys=keys, values=values, table=table)


def _read(path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


def test_csv_cells_are_python_rounded_reprs_for_edge_and_random_values(tmp_path):
    gen = torch.Generator().manual_seed(3)
    randoms = (torch.randn(4000, generator=gen, dtype=torch.float64)
               * 10.0 ** torch.randint(-9, 9, (4000,), generator=gen)).tolist()
    flat = EDGE_VALUES + randoms
    flat += [0.0] * (len(flat) % 2)
    values = [flat[i:i + 2] for i in range(0, len(flat), 2)]
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
            assert row[3:] == [repr(round(v, 6)) for v in want]


def test_csv_micro_step_column_and_quoted_names(tmp_path):
    keys = [RowKey("actv", "blocks.0, odd", 1, 2), RowKey("actv", "blocks.1", 0, None)]
    sink = CsvSink(str(tmp_path), ndigits=3, step_count_per_record=10)
    sink.write(_record([[1.23456, 2.0], [3.0, math.nan]], keys, True))
    sink.write(StepRecord(step=8, rank=0, ops=["a", "b"], keys=keys[:1], values=[[0.5, 0.25]],
                          table=torch.tensor([[0.5, 0.25]], dtype=torch.float64)))
    sink.close()
    rows = _read(tmp_path / "actv_0-9.csv")
    assert rows == [["vpp_stage", "name", "step", "micro_step", "a", "b"],
                    ["1", "blocks.0, odd", "7", "2", "1.235", "2.0"],
                    ["0", "blocks.1", "7", "", "3.0", "nan"],
                    ["1", "blocks.0, odd", "8", "2", "0.5", "0.25"]]


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


def test_vectorised_rounding_equals_python_round_near_ties_and_at_every_scale():
    from msmon.sinks.csv_sink import round_like_python

    gen = torch.Generator().manual_seed(11)
    table = torch.randn(5000, 4, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -12, 18, (5000, 4), generator=gen)
    ties = torch.tensor([k / 128 for k in range(-256, 256)], dtype=torch.float64)  # exact decimal ties at 6 digits
    near = torch.nextafter(ties, torch.full_like(ties, math.inf))
    table = torch.cat([table.flatten(), ties, near, torch.tensor([math.nan, math.inf, -math.inf, -0.0, 5e-324])])
    table = table.view(-1, 1)
    for ndigits in (0, 2, 6, 9, 17):
        got = [repr(row[0]) for row in round_like_python(table, ndigits)]
        assert got == [repr(round(v, ndigits)) for v in table.flatten().tolist()]  # repr: NaN equals itself

"""The by_rank layout's summary lanes, written by the TensorBoard sink and read back with
tensorboard's EventAccumulator: per category and op the largest value over the category's
tensors (checked against Python's max of the values given), a NaN counted as the largest, and
the text table naming the tensor that holds each."""

from __future__ import annotations

import math

import pytest

from msmon.output.sinks.tensorboard_sink import TensorBoardSink
from msmon.records.rows import RowKey, StepRecord


def read_back(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def holders(acc, step: int) -> dict[tuple[str, str], tuple[str, str]]:
    (event,) = [e for e in acc.Tensors("summary/max_holders") if e.step == step]
    rows = [line.strip("|").split("|") for line in event.tensor_proto.string_val[0].decode().splitlines()[2:]]
    return {(c.strip(), o.strip()): (v.strip(), t.strip()) for c, o, v, t in rows}


def test_lanes_hold_each_categorys_largest_value_and_name_its_tensor_a_nan_counting_as_largest(tmp_path):
    keys = [RowKey("grad_reduced", "a.weight"), RowKey("actv", "a.output", micro_step=1)]
    keys += [RowKey("grad_reduced", "b.weight"), RowKey("actv", "b.output", micro_step=0)]
    steps = {
        0: [[1.5, -2.0], [7.0, 0.0], [2.5, -3.0], [7.0, 1.0]],  # a tie: the first tensor holds it
        1: [[1.5, -2.0], [7.0, 0.0], [math.nan, -3.0], [8.0, 1.0]],  # b.weight's norm turns NaN
    }
    sink = TensorBoardSink(str(tmp_path), by_rank=True)
    for step, values in steps.items():
        sink.write(StepRecord(step=step, rank=3, ops=["norm", "min"], keys=keys, values=values))
    sink.close()
    acc = read_back(tmp_path)
    tags = acc.Tags()["scalars"]
    assert sorted(t for t in tags if t.startswith("summary/")) == [
        "summary/actv/min_max",
        "summary/actv/norm_max",
        "summary/grad_reduced/min_max",
        "summary/grad_reduced/norm_max",
    ]
    assert "0:a.output:1/actv_norm" in tags and not any("rank3" in t for t in tags)
    for step, values in steps.items():
        table = holders(acc, step)
        for category in ("grad_reduced", "actv"):
            rows = [(k.display_name(), v) for k, v in zip(keys, values) if k.category == category]
            for j, op in enumerate(["norm", "min"]):
                (lane,) = [e.value for e in acc.Scalars(f"summary/{category}/{op}_max") if e.step == step]
                column = [v[j] for _, v in rows]
                if any(math.isnan(v) for v in column):
                    assert math.isnan(lane)
                    expected_holder = next(name for name, v in rows if math.isnan(v[j]))
                else:
                    assert lane == pytest.approx(max(column))
                    expected_holder = next(name for name, v in rows if v[j] == max(column))
                assert table[(category, op)][1] == expected_holder, (step, category, op)
    assert holders(acc, 0)[("actv", "norm")] == ("7", "0:a.output:1")
    assert holders(acc, 1)[("grad_reduced", "norm")] == ("nan", "0:b.weight")


def test_the_default_layout_writes_no_lane_and_keeps_the_rank_in_the_tag(tmp_path):
    sink = TensorBoardSink(str(tmp_path))
    sink.write(StepRecord(step=0, rank=3, ops=["norm"], keys=[RowKey("grad_reduced", "a.weight")], values=[[1.0]]))
    sink.close()
    acc = read_back(tmp_path)
    assert acc.Tags()["scalars"] == ["0:a.weight/rank3/grad_reduced_norm"] and acc.Tags()["tensors"] == []


def test_a_step_with_loss_and_agreement_rows_gets_one_holders_table_naming_every_category(tmp_path):
    """The writer thread hands a step's statistics and its column categories (loss, grad_agreement)
    to the sinks as separate records; TensorBoard keeps one text per tag and step, so the by_rank
    sink makes them one table."""
    import torch

    from msmon.output.writer import BackgroundWriter
    from msmon.runtime.transfer import HostBatch

    keys = [
        RowKey("grad_reduced", "a.weight"),
        RowKey("loss", "loss", micro_step=0, op="value"),
        RowKey("grad_agreement", "a.weight", op="cos"),
        RowKey("grad_agreement", "a.weight", op="norm_ratio"),
    ]
    writer = BackgroundWriter([TensorBoardSink(str(tmp_path), by_rank=True)], rank=0)
    try:
        for step in range(3):
            values = torch.tensor([[4.0 + step], [2.5], [0.25], [1.5]], dtype=torch.float64)
            writer.submit(step, ["norm"], HostBatch(keys=keys, values=values))
        writer.drain()
    finally:
        writer.close()
    acc = read_back(tmp_path)
    assert [e.step for e in acc.Tensors("summary/max_holders")] == [0, 1, 2]  # one table a step
    for step in range(3):
        assert holders(acc, step) == {
            ("grad_reduced", "norm"): (f"{4.0 + step:g}", "0:a.weight"),
            ("loss", "value"): ("2.5", "0:loss:0"),
            ("grad_agreement", "cos"): ("0.25", "0:a.weight"),
            ("grad_agreement", "norm_ratio"): ("1.5", "0:a.weight"),
        }
    assert [e.value for e in acc.Scalars("0:a.weight/grad_agreement_norm_ratio")] == [1.5, 1.5, 1.5]
    assert [e.value for e in acc.Scalars("summary/loss/value_max")] == [2.5, 2.5, 2.5]

"""The scalars' Summary bytes written without protobuf objects are the bytes protobuf writes."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

from msmon.output.sinks import summary_wire
from msmon.output.sinks.tensorboard_sink import TensorBoardSink
from msmon.records.rows import RowKey, StepRecord

VALUES = [
    1.5,
    -0.0,
    0.0,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e39,
    -1e39,
    1e-40,
    1e-46,
    3.4028235e38,
    123456.789,
]
TAGS = ["0:a/rank0/actv_norm", "0:" + "é" * 70 + "/rank3/grad_reduced_max", "x" * 200]


@pytest.mark.parametrize("step", [0, 1, 127, 128, 300_000, 2**40])
def test_an_event_of_scalars_and_a_histogram_is_byte_for_byte_what_protobuf_serializes(step):
    tags = [f"{TAGS[i % len(TAGS)]}_{i}" for i in range(len(VALUES))]
    histogram = HistogramProto(
        min=0.0, max=2.0, num=3.0, sum=3.0, sum_squares=5.0, bucket_limit=[1.0, 2.0], bucket=[1, 2]
    )
    expected = Event(
        wall_time=1796355945.7732165,
        step=step,
        summary=Summary(
            value=[Summary.Value(tag=t, simple_value=v) for t, v in zip(tags, VALUES)]
            + [Summary.Value(tag="h", histo=histogram)]
        ),
    ).SerializeToString()
    body = summary_wire.scalars(
        [summary_wire.scalar_prefix(t) for t in tags],
        summary_wire.float32_bytes(torch.tensor(VALUES, dtype=torch.float64)),
    )
    body += summary_wire.entry(Summary.Value(tag="h", histo=histogram).SerializeToString())
    assert summary_wire.event(1796355945.7732165, step, body) == expected


def test_an_empty_summary_is_what_protobuf_serializes():
    assert summary_wire.event(5.0, 3, b"") == Event(wall_time=5.0, step=3, summary=Summary()).SerializeToString()


def test_varint_matches_protobufs_for_every_length_class():
    for n in [0, 1, 127, 128, 16383, 16384, 2**21, 2**35, 2**63 - 1]:
        event = Event(step=n).SerializeToString()
        assert event == (b"\x10" + summary_wire.varint(n) if n else b"")


def test_the_sink_writes_every_scalar_as_float32_under_its_tag(tmp_path):
    ops = ["norm", "min", "max"]
    keys = [RowKey("actv", f"layers.{i}.out", 0, 0) for i in range(4)]
    table = torch.tensor([VALUES[i * 3 : i * 3 + 3] for i in range(4)], dtype=torch.float64)
    sink = TensorBoardSink(str(tmp_path))
    for step, with_table in [(0, True), (7, False)]:  # with the host table, and from the rows alone
        record = StepRecord(
            step=step, rank=2, ops=ops, keys=keys, values=table.tolist(), table=table if with_table else None
        )
        sink.write(record)
    sink.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert len(events.Tags()["scalars"]) == 12
    for key, row in zip(keys, table.tolist()):
        for op, value in zip(ops, row):
            told = events.Scalars(f"{key.tag(2)}_{op}")
            assert [e.step for e in told] == [0, 7]
            for e in told:
                assert (math.isnan(e.value) and math.isnan(value)) or e.value == _as_float32(value), (key, op)


def _as_float32(value: float) -> float:
    """IEEE rounding to float32, ±inf beyond its range (as protobuf stores a float field)."""
    if abs(value) >= 3.4028235677973366e38:
        return math.copysign(math.inf, value)
    return struct.unpack("<f", struct.pack("<f", value))[0]

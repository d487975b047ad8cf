"""The writer only moves steps: each step goes to every sink, then to every consumer handed in
(output.handoff), on the writer thread; a consumer's failed write to disk stops the output as a
sink's does, any other failure is logged for that step and the next step still reaches it."""

from __future__ import annotations

import errno
import logging

import torch

from msmon.output.handoff import StepConsumer
from msmon.output.sinks.base import Sink
from msmon.output.writer import BackgroundWriter
from msmon.records.rows import RowKey, StepRecord
from msmon.runtime.transfer import HostBatch

EVENTS: list[tuple[str, int]] = []


class RecordingSink(Sink):
    writes_files = True

    def write(self, record: StepRecord) -> None:
        EVENTS.append(("sink", record.step))


class RecordingConsumer(StepConsumer):
    """Records what it gets; fails as told at given steps."""

    def __init__(self, label: str, fail: dict[int, Exception] | None = None) -> None:
        self.label = label
        self.fail = fail or {}
        self.values: list[float] = []
        self.stopped = 0

    def consume(self, record: StepRecord, batch: HostBatch) -> None:
        EVENTS.append((self.label, record.step))
        self.values.append(float(batch.values[0, 0]))
        if record.step in self.fail:
            raise self.fail[record.step]

    def output_stopped(self) -> None:
        self.stopped += 1


def batch(step: int) -> HostBatch:
    return HostBatch(keys=[RowKey("param_updated", "w", 0)], values=torch.tensor([[float(step)]], dtype=torch.float64))


def write_steps(writer: BackgroundWriter, steps: int) -> None:
    try:
        for step in range(steps):
            writer.submit(step, ["norm"], batch(step))
        writer.drain()
    finally:
        writer.close()


def test_each_step_reaches_every_sink_then_every_consumer_in_the_order_given():
    EVENTS.clear()
    first, second = RecordingConsumer("first"), RecordingConsumer("second")
    sink = RecordingSink()
    writer = BackgroundWriter([sink], rank=0, consumers=[first, second])
    write_steps(writer, 2)
    assert EVENTS == [("sink", 0), ("first", 0), ("second", 0), ("sink", 1), ("first", 1), ("second", 1)]
    assert first.values == second.values == [0.0, 1.0]
    assert writer.steps_written == 2


def test_a_consumers_failed_write_to_disk_stops_the_output_once_and_tells_every_consumer(caplog):
    EVENTS.clear()
    full = OSError(errno.ENOSPC, "No space left on device")
    full.filename = "/out/anomaly_detected/rank2/anomaly.jsonl"
    failing, other = RecordingConsumer("failing", {1: full}), RecordingConsumer("other")
    stopped: list[dict] = []
    writer = BackgroundWriter([RecordingSink()], rank=2, consumers=[failing, other], on_output_stopped=stopped.append)
    with caplog.at_level(logging.ERROR, logger="msmon"):
        write_steps(writer, 3)
    assert stopped == [{"step": 1, "errno": "ENOSPC", "error": "No space left on device", "path": full.filename}]
    assert (failing.stopped, other.stopped) == (1, 1)
    assert writer.sinks == []  # the file sink is closed; nothing more goes to disk
    assert [e for e in EVENTS if e[0] != "sink"] == [(c, s) for s in range(3) for c in ("failing", "other")]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"msmon[rank 2]: output stopped at step 1: No space left on device (ENOSPC) writing {full.filename}; "
        "nothing more is written to disk, training continues"
    ]


def test_a_consumer_failing_otherwise_is_logged_for_its_step_and_still_gets_the_next(caplog):
    EVENTS.clear()
    broken = RecordingConsumer("broken", {0: ValueError("a bad rule")})
    writer = BackgroundWriter([RecordingSink()], rank=1, consumers=[broken])
    with caplog.at_level(logging.ERROR, logger="msmon"):
        write_steps(writer, 2)
    assert broken.values == [0.0, 1.0] and broken.stopped == 0
    assert [r.getMessage() for r in caplog.records] == [
        "msmon[rank 1]: writing step statistics failed: ValueError('a bad rule')"
    ]

"""The writer thread yields the CPU to the training (nice 19, its own thread only) and never
falls behind without bound: past `max_backlog` waiting steps the training waits for it."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest
import torch

from conftest import MLP, rank_dir, read_csv_rows, train_steps
from msmon import TrainerMon
from msmon.output.sinks.base import Sink
from msmon.output.writer import BackgroundWriter
from msmon.records.rows import RowKey, StepRecord
from msmon.runtime.transfer import HostBatch
from msmon.system.thread_priority import ENV, writer_nice

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")


def writer_thread(monitor: TrainerMon) -> threading.Thread:
    """This monitor's writer thread (not the first one by name: a writer another test left
    running, at its own priority, would pass for it)."""
    writer = monitor.writer
    assert writer is not None
    return writer._thread


def nice_of(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def monitored_steps(write_config, steps: int = 2) -> TrainerMon:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(
        write_config({"wg_distribution": True, "param_distribution": True, "format": "csv", "ops": ["norm"]})
    )
    monitor.set_monitor(model, optimizer)
    train_steps(model, optimizer, steps)
    monitor.writer.drain()
    return monitor


@linux_only
def test_the_writer_thread_runs_at_nice_19_and_the_training_thread_keeps_its_priority(
    write_config, output_dir, monkeypatch
):
    monkeypatch.delenv(ENV, raising=False)
    training = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    monitor = monitored_steps(write_config)
    try:
        assert nice_of(writer_thread(monitor)) == min(19, training + 19)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == training
        assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == training  # the main thread's
    finally:
        monitor.close()
    assert [r["step"] for r in read_csv_rows(rank_dir(output_dir), "param_updated")][-1] == "1"


@linux_only
def test_msmon_writer_nice_0_keeps_the_writer_at_the_trainings_priority(write_config, output_dir, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    monitor = monitored_steps(write_config)
    try:
        assert nice_of(writer_thread(monitor)) == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    finally:
        monitor.close()


@pytest.mark.parametrize("text", ["high", "20", "-1"])
def test_a_wrong_msmon_writer_nice_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(ENV, text)
    with pytest.raises(ValueError, match=ENV):
        writer_nice()


class HeldSink(Sink):
    """Writes nothing until released: a writer that cannot keep up."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.steps: list[int] = []

    def write(self, record: StepRecord) -> None:
        self.release.wait(timeout=30)
        self.steps.append(record.step)


def batch(step: int) -> HostBatch:
    return HostBatch(keys=[RowKey("param_updated", "w", 0)], values=torch.tensor([[float(step)]], dtype=torch.float64))


def test_past_max_backlog_waiting_steps_submit_waits_for_the_writer_and_nothing_is_lost(caplog):
    sink = HeldSink()
    writer = BackgroundWriter([sink], rank=3, max_backlog=2)
    try:
        writer.submit(0, ["norm"], batch(0))  # taken by the writer thread, held in the sink
        while writer._queue.qsize():
            time.sleep(0.01)
        for step in (1, 2):
            writer.submit(step, ["norm"], batch(step))
        blocked = threading.Thread(target=writer.submit, args=(3, ["norm"], batch(3)))
        with caplog.at_level(logging.WARNING, logger="msmon"):
            blocked.start()
            blocked.join(timeout=1.0)
            assert blocked.is_alive()  # the training waits: 2 steps are queued behind the one being written
            sink.release.set()
            blocked.join(timeout=30)
        assert not blocked.is_alive()
        writer.drain()
        assert sink.steps == [0, 1, 2, 3]
        assert writer.waited_for == 1
        said = [r.getMessage() for r in caplog.records if "steps behind" in r.getMessage()]
        assert len(said) == 1 and "rank 3" in said[0] and "2 steps behind" in said[0]
    finally:
        sink.release.set()
        writer.close()


def test_the_writer_makes_no_list_per_row_unless_a_reader_asks_and_the_api_still_reads_values(write_config, output_dir):
    """CSV, TensorBoard and the alert rules read the step's table; a list per row per step would
    only feed the garbage collector. The API sink, asked, still gets every value."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TrainerMon(
        write_config(
            {
                "wg_distribution": True,
                "format": ["csv", "tensorboard", "api"],
                "ops": ["norm", "max"],
                "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 3.0}}]},
            }
        )
    )
    monitor.set_monitor(model, optimizer)
    for _ in range(3):
        model(torch.randn(5, 8)).square().mean().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    monitor.writer.drain()
    try:
        record = monitor.output.api._latest["grad_reduced"]
        assert record._values is None  # nothing asked for the rows as lists
        reduced, _ = monitor.generate_wgrad_metrics()
        assert record._values is not None
        assert len(reduced) == len(grads)
        for tag, values in reduced.items():
            name = tag.split(":", 1)[1].split("/")[0]
            assert values["norm"] == pytest.approx(grads[name].norm().item(), rel=1e-6)
    finally:
        monitor.close()

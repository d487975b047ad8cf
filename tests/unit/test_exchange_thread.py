"""runtime/exchange_thread.py: the one background thread that runs the replica check's and
AnomalyRankOutlier's exchanges off the training thread (their collectives across ranks are
tested end to end: tests/e2e/test_replica_check.py, tests/e2e/test_rank_outlier.py)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from msmon.runtime.exchange_thread import ExchangeThread


@dataclass
class Job:
    step: int


@dataclass
class State:
    off: str | None = None


def test_jobs_run_on_the_thread_in_the_order_they_were_put():
    runner: ExchangeThread[Job] = ExchangeThread()
    seen: list[tuple[int, str]] = []
    runner.start(
        "msmon-test-exchange",
        0,
        State(),
        lambda job: seen.append((job.step, threading.current_thread().name)),
        "test",
        "testing",
    )
    for step in range(5):
        runner.put(Job(step))
    assert runner.flush(10.0) == 0 and runner.pending == 0
    assert seen == [(step, "msmon-test-exchange") for step in range(5)]
    assert runner.thread is not None and runner.thread.daemon


def test_a_failure_is_logged_once_switches_the_feature_off_and_skips_the_jobs_after_it(caplog):
    state, ran, reports = State(), [], []

    def run(job: Job) -> None:
        ran.append(job.step)
        if job.step == 1:
            raise RuntimeError("a rank is gone")

    runner: ExchangeThread[Job] = ExchangeThread()
    with caplog.at_level(logging.ERROR, logger="msmon"):
        runner.start(
            "msmon-test-exchange", 3, state, run, "replica check", "exchanging", failed=lambda: reports.append(1)
        )
        for step in range(4):
            runner.put(Job(step))
        assert runner.flush(10.0) == 0
    assert ran == [0, 1]  # steps 2 and 3 taken off the queue without being run
    assert state.off == "exchanging failed: RuntimeError('a rank is gone')"
    lines = [r.getMessage() for r in caplog.records if r.name == "msmon"]
    assert lines == [
        "msmon[rank 3]: replica check at step 1 failed and is switched off; training continues: "
        "RuntimeError('a rank is gone')"
    ]
    assert reports == [1]


def test_flush_waits_a_bounded_time_and_says_how_many_jobs_are_left():
    release = threading.Event()
    runner: ExchangeThread[Job] = ExchangeThread()
    runner.start("msmon-test-exchange", 0, State(), lambda job: release.wait(10.0), "test", "testing")
    runner.put(Job(0))
    runner.put(Job(1))
    assert runner.flush(0.05) == 2 and runner.pending == 2  # one waiting on the "other ranks", one queued
    release.set()
    assert runner.flush(10.0) == 0

"""Repeated alerts collapse for every rule (output/repeats.py): the first alert of a rule on a
tensor is logged, its repeats counted, one line per rule and tensor when the monitor closes, and
only then, even when the writer restarted in between. AnomalyNan is tested in
tests/unit/test_runs_and_quiet_alerts.py; the rules that compare ranks (AnomalyRankOutlier,
ReplicaMismatch) on real ranks in tests/e2e/test_rank_outlier.py, test_fault_kinds.py and
test_replica_check.py. And the end-of-job kind reader (offline/analyse/run_kind.py)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon
from msmon.anomaly.dump import AnomalyDumpWriter
from msmon.offline.analyse.run_kind import STEP_MARGIN, run_fault_kind
from msmon.output.repeats import AlertRepeats


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(mon: TrainerMon, model: torch.nn.Module, optimizer, inputs, restart_at: int | None = None) -> list[str]:
    handler = _Lines()
    logging.getLogger("msmon").addHandler(handler)
    try:
        for step, x in enumerate(inputs):
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == restart_at:  # an edit of the output settings restarts the writer mid-run
                mon.output.restart_writer(mon.config)
        mon.close()
    finally:
        logging.getLogger("msmon").removeHandler(handler)
    return [line for line in handler.lines if line.startswith("msmon alert")]


def test_nan_origin_repeats_are_counted_and_said_once_at_the_close_not_at_a_writer_restart(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = {
        "xy_distribution": True,
        "format": "csv",
        "ops": ["norm"],
        "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
    }
    mon = TrainerMon(write_config(config))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    lines = _train(mon, model, optimizer, [torch.full((2, 8), math.nan)] * 7, restart_at=3)
    origin_lines = [line for line in lines if "(NanOrigin)" in line]
    assert len(origin_lines) == 1 and " step 0 " in origin_lines[0]  # the first step, then counted
    counts = [line for line in lines if " NanOrigin on " in line]
    assert counts == [
        "msmon alert [rank 0] NanOrigin on 0:fc1.input:0/rank0/actv: alerted in 7 steps, 0 to 6 "
        "(the first one logged; all in the anomaly dump)"
    ]
    # said once, at the close, after every step's line: the restart at step 3 said nothing
    assert lines.index(counts[0]) > max(i for i, line in enumerate(lines) if " micro-step " in line)
    said = [line.split(": alerted in")[0] for line in lines if " alerted in " in line]
    assert len(said) == len(set(said)), said  # each rule and tensor once


def test_turbulence_repeats_on_one_tensor_are_one_line_and_one_count(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = {
        "xy_distribution": True,
        "targets": {"fc1": {"input": "tensor"}},
        "format": "csv",
        "ops": ["norm"],
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 2.0}}], "dump": True},
        "nan_origin": False,
    }
    mon = TrainerMon(write_config(config))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    calm = [torch.ones(2, 8)] * 6
    spikes = [torch.ones(2, 8) * (100.0 if i % 2 == 0 else 1.0) for i in range(6)]  # 100x at steps 6, 8, 10
    lines = _train(mon, model, optimizer, calm + spikes)
    step_lines = [line for line in lines if " micro-step " in line and "fc1.input" in line]
    assert len(step_lines) == 1 and " step 6 " in step_lines[0] and "(AnomalyTurbulence)" in step_lines[0]
    dump = output_dir / "anomaly_detected" / "rank0" / "anomaly.jsonl"
    steps = sorted(
        {r["step"] for r in map(json.loads, dump.read_text().splitlines()) if r["name"] == "fc1.input"}
    )  # the dump keeps every alert: the steps the count must give
    assert len(steps) >= 3 and steps[0] == 6
    assert (
        f"msmon alert [rank 0] AnomalyTurbulence on 0:fc1.input:0/rank0/actv: alerted in {len(steps)} steps, "
        f"{steps[0]} to {steps[-1]} (the first one logged; all in the anomaly dump)"
    ) in lines


def test_a_repeat_is_counted_once_per_step_whatever_its_micro_steps_and_a_single_alert_says_no_count():
    repeats = AlertRepeats(3)
    assert repeats.first(("R", "t"), "R", "tag", 5)
    assert not repeats.first(("R", "t"), "R", "tag", 5)  # another micro-step of step 5
    assert not repeats.first(("R", "t"), "R", "tag", 7)
    assert repeats.first(("R", "u"), "R", "once", 7)
    assert repeats.first(("Q", "t"), "Q", "tag", 7)  # another rule on the same tensor: its own line
    assert repeats.lines() == [
        "msmon alert [rank 3] R on tag: alerted in 2 steps, 5 to 7 (the first one logged; all in the anomaly dump)"
    ]
    checks = AlertRepeats(0)
    for step in (10, 15, 20):
        checks.first(("ReplicaMismatch", "fc1.weight"), "ReplicaMismatch", "the replicas of fc1.weight", step, "checks")
    assert checks.lines() == [
        "msmon alert [rank 0] ReplicaMismatch on the replicas of fc1.weight: alerted in 3 checks, steps 10 to 20 "
        "(the first one logged; all in the anomaly dump)"
    ]


def _record(step: int, category: str, name: str, rule: str = "AnomalyNan", **extra) -> dict:
    return {"step": step, "stage": "forward", "category": category, "name": name, "rule": rule, **extra}


@pytest.mark.parametrize("older_run_first", [True, False])
def test_the_end_of_job_kind_reads_only_this_runs_first_steps_and_every_replica_check(tmp_path, older_run_first):
    base = str(tmp_path / "out")

    def write(run_id: str, rank: int, records: list[dict]) -> None:
        writer = AnomalyDumpWriter(base, rank, 0, [rank])
        writer.run_id = run_id  # the run each record names (records/runs.py)
        writer.append(records)

    older = [_record(1, "actv", "fc1.input")]  # an earlier run into the same directory: every rank at step 1
    mine = {
        0: [_record(4, "grad_reduced", "fc2.weight", stage="optimizer")],
        1: [
            _record(4, "actv", "fc2.output", "NanOrigin", micro_step=0),
            _record(4, "actv", "fc2.output", micro_step=0),
        ],
    }
    later = [_record(4 + STEP_MARGIN + 1 + s, "actv", "fc1.input") for s in range(50)]  # everything NaN: not read
    for rank in (0, 1):
        if older_run_first:
            write("20261206-090000-aaaaaa", rank, older)
        write("20261206-100000-bbbbbb", rank, mine[rank] + later)
    kind = run_fault_kind(f"{base}/anomaly_detected", "20261206-100000-bbbbbb")
    assert kind is not None and (kind.code, kind.rank, kind.step, kind.module) == (
        "one_rank_data_or_device",
        1,
        4,
        "fc2",
    )
    # a replica check far after the first steps is still read: it makes the kind the rank's copy of the model
    write(
        "20261206-100000-bbbbbb",
        1,
        [_record(90, "param_updated", "fc2.weight", "ReplicaMismatch", stage="optimizer", call_id=1 << 30)],
    )
    kind = run_fault_kind(f"{base}/anomaly_detected", "20261206-100000-bbbbbb")
    assert kind is not None and (kind.code, kind.rank) == ("one_rank_model_copy", 1)
    assert "found its replicated weights differing at step 90" in kind.why

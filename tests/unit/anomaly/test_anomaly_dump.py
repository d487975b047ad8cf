"""The anomaly dump: append-only JSON lines with everything the analyser orders by."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import MLP, ROOT
from msmon import TrainerMon
from msmon.anomaly.dump import FIELDS, AnomalyDumpWriter, dump_path
from msmon.anomaly.rules import Alert
from msmon.records.rows import RowKey, StepRecord


def read_records(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def step_record(step: int) -> StepRecord:
    return StepRecord(step=step, rank=3, ops=["norm"], keys=[], values=[])


def test_a_record_carries_every_field_in_a_fixed_order_with_non_finite_numbers_as_strings(tmp_path):
    writer = AnomalyDumpWriter(str(tmp_path), rank=3, pp_stage=1, group_mates=[1, 3])
    alerts = [
        Alert(RowKey("actv", "layers.2.fc2.output", 1, 2), 17, "norm", math.inf, 2.5, "AnomalyNan", "norm=inf"),
        Alert(RowKey("grad_reduced", "layers.2.fc2.weight", 1), 40, "norm", math.nan, None, "AnomalyNan", "x"),
    ]
    writer.write(step_record(41210), alerts)
    records = read_records(dump_path(str(tmp_path), 3))
    assert list(records[0]) == list(FIELDS)
    assert records[0] == {
        "rank": 3,
        "step": 41210,
        "micro_step": 2,
        "pp_stage": 1,
        "vpp_stage": 1,
        "stage": "forward",
        "call_id": 17,
        "tag": "1:layers.2.fc2.output:2/rank3/actv",
        "name": "layers.2.fc2.output",
        "category": "actv",
        "op": "norm",
        "value": "inf",
        "history": 2.5,
        "rule": "AnomalyNan",
        "message": "norm=inf",
        "group_mates": [1, 3],
    }
    # a statistic of the whole step has no micro-step, and the optimizer stage
    assert (records[1]["micro_step"], records[1]["stage"], records[1]["value"]) == (None, "optimizer", "nan")


def test_records_are_appended_never_rewritten_even_by_a_second_run(tmp_path):
    first = AnomalyDumpWriter(str(tmp_path), 0, 0, [0])
    alert = Alert(RowKey("actv", "fc1.output", 0, 0), 0, "nans", 3.0, None, "AnomalyNan", "3 NaN values")
    first.write(step_record(1), [alert])
    first.write(step_record(2), [alert, alert])
    second = AnomalyDumpWriter(str(tmp_path), 0, 0, [0])  # a restarted job, same output directory
    second.write(step_record(0), [alert])
    assert [r["step"] for r in read_records(first.path)] == [1, 2, 2, 0]


def test_a_line_torn_by_a_killed_run_does_not_swallow_the_next_runs_first_record(tmp_path):
    path = dump_path(str(tmp_path), 0)
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as fh:
        fh.write('{"rank": 0, "step": 7, "micro_st')  # killed mid-write
    writer = AnomalyDumpWriter(str(tmp_path), 0, 0, [0])
    writer.write(step_record(0), [Alert(RowKey("actv", "fc1.output", 0, 0), 0, "infs", 1.0, None, "AnomalyNan", "x")])
    lines = open(path).read().splitlines()
    assert lines[0] == '{"rank": 0, "step": 7, "micro_st'
    assert json.loads(lines[1])["step"] == 0


def test_ready_made_records_are_completed_and_checked(tmp_path):
    writer = AnomalyDumpWriter(str(tmp_path), 2, 1, [0, 2])
    writer.append(
        [
            {
                "step": 5,
                "micro_step": 1,
                "stage": "backward",
                "call_id": 9,
                "name": "fc2.input",
                "category": "actv_grad",
                "rule": "NanOrigin",
                "op": "nonfinite",
                "value": math.nan,
            }
        ]
    )
    (record,) = read_records(writer.path)
    assert (record["rank"], record["pp_stage"], record["group_mates"]) == (2, 1, [0, 2])
    assert (record["tag"], record["value"]) == ("0:fc2.input:1/rank2/actv_grad", "nan")
    with pytest.raises(ValueError, match="lacks stage"):
        writer.append([{"step": 5, "name": "fc2.input", "category": "actv_grad", "rule": "NanOrigin"}])
    with pytest.raises(ValueError, match="stage must be one of"):
        writer.append([{"step": 5, "stage": "sideways", "name": "x", "category": "actv", "rule": "NanOrigin"}])
    assert len(read_records(writer.path)) == 1


def test_a_monitored_run_dumps_the_first_nan_with_its_micro_step_and_call_order(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = {
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "format": "csv",
        "ops": ["norm", "max", "nans", "infs"],
        "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
    }
    mon = TrainerMon(write_config(cfg))
    mon.set_monitor(model, optimizer, grad_acc_steps=2)
    for step in range(3):
        for micro in range(2):
            x = torch.randn(4, 8)
            if (step, micro) == (2, 1):
                x[0, 0] = math.nan
            model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    records = read_records(output_dir / "anomaly_detected" / "rank0" / "anomaly.jsonl")
    alerts = [r for r in records if r["rule"] == "AnomalyNan"]
    assert {r["step"] for r in records} == {2}
    first = min(alerts, key=lambda r: r["call_id"])
    assert (first["name"], first["micro_step"], first["stage"], first["op"], first["value"]) == (
        "fc1.input",
        1,
        "forward",
        "nans",
        1.0,
    )
    forward = [r for r in alerts if r["stage"] == "forward"]
    assert [r["name"] for r in sorted(forward, key=lambda r: r["call_id"])] == [
        "fc1.input",
        "fc1.output",
        "act.input",
        "act.output",
        "fc2.input",
        "fc2.output",
    ]
    assert {r["category"] for r in alerts if r["stage"] == "optimizer"} == {"grad_reduced"}
    assert all(r["micro_step"] is None for r in alerts if r["stage"] == "optimizer")


@pytest.mark.e2e
def test_pipeline_stage_comes_from_the_given_group_never_from_the_global_rank(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(ROOT / "tests" / "scripts" / "anomaly_pipeline_position.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"position_rank{rank}.json").read_text())
        assert seen["none"] == [0, [rank]], "no group, no framework: stage 0, not the global rank"
        assert seen["pair"] == [rank, [0, 1]], "a two-stage pipeline group: the rank within it"
        assert seen["own"] == [0, [rank]], "a group of one: stage 0 even on global rank 1"
        assert seen["foreign"] == [0, [rank]], "a group this rank is not in is ignored"
        assert seen["monitor"] == [rank, [0, 1]], "TrainerMon(process_group=...) uses it"

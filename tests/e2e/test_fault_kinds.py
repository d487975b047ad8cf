"""The kind of fault on real torchrun ranks (2 gloo ranks under `msmon run`, DDP, the unmodified
script tests/scripts/rank_outlier_ddp.py), read back the three ways a user reads it: `msmon
analyse` (its text and its JSON), the report's banner (`msmon db` + `msmon report`: the kind the
page draws at the top) and the line `msmon run` prints when the job ends. One job per scenario:

- a NaN made by one layer (fc1's output) on rank 1 alone: it reaches rank 0 through the gradient
  all-reduce in the same step, so every rank has an anomaly there; the kind is still rank 1's;
- the same bad batch (a NaN in the input) on every rank: all ranks together;
- rank 1 fed inputs scaled by 40 (finite) from step 9: named at step 9 first, by AnomalyRankOutlier
  on two ranks (each rank against its own history), with no alarm before and none on rank 0.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_replica_check import clean_env, dump_records, msmon_run

NAN_CONFIG = {
    "xy_distribution": True,
    "wg_distribution": True,
    "ops": ["norm", "nans"],
    "format": "csv",
    "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
}
OUTLIER_CONFIG = {
    **NAN_CONFIG,
    "alert": {"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyRankOutlier"}], "dump": True},
}
NAN_STEP, SCALE_STEP, SCALE_STEPS = 3, 9, 12


def read_back(work: Path) -> tuple[str, dict, dict]:
    """(analyse's text, its JSON, the report page's anomaly data: the banner's kind and verdict)."""
    out = work / "out"
    analysed = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "analyse", "-d", str(out / "anomaly_detected")],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert analysed.returncode == 0, analysed.stderr
    report = json.loads((out / "anomaly_detected" / "msmon_analyse.json").read_text())
    page = work / "report.html"
    made = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "report", "-d", str(out), "--no-progress", "-o", str(page)],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert made.returncode == 0, made.stderr
    html = page.read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="msmon-data">(.*?)</script>', html, re.S)[1])
    return analysed.stdout, report, data["anomalies"]


def assert_kind(kind: dict, code: str, rank: int | None, step: int, module: str) -> None:
    assert (kind["code"], kind["rank"], kind["step"], kind["module"]) == (code, rank, step, module), kind


@pytest.mark.e2e
def test_a_nan_made_by_one_layer_on_rank_1_alone_is_rank_1s_fault_naming_that_layer(tmp_path):
    proc = msmon_run(
        tmp_path,
        2,
        NAN_CONFIG,
        "rank_outlier_ddp.py",
        "--steps",
        str(NAN_STEP + 2),
        "--nan-rank",
        "1",
        "--nan-step",
        str(NAN_STEP),
        "--nan-module",
        "fc1",
        "--out",
        str(tmp_path),
    )
    records = dump_records(tmp_path)
    at_step = {rank: [r for r in recs if r["step"] == NAN_STEP] for rank, recs in records.items()}
    # the all-reduce brought it to rank 0 in the same step: counting ranks said "all ranks together"
    assert sorted(r for r, recs in at_step.items() if recs) == [0, 1]
    rank0 = {(r["category"], r["rule"]) for r in at_step[0]}
    assert not {c for c, _ in rank0} & {"actv", "actv_grad", "grad_unreduced"}, rank0  # its own values stayed finite
    assert ("grad_reduced", "NanOrigin") in rank0
    origin = next(r for r in at_step[1] if r["rule"] == "NanOrigin")
    assert (origin["name"], origin["category"]) == ("fc1.output", "actv")

    text, report, banner = read_back(tmp_path)
    expected = (
        "Kind: rank 1: its data or its device; rank-local values turned first, "
        f"on rank 1 only (forward output of fc1 at step {NAN_STEP}, first non-finite there); rank 0 turned only "
        "after the reduction"
    )
    assert expected in text
    assert_kind(report["kind"], "one_rank_data_or_device", 1, NAN_STEP, "fc1")
    assert banner["kind"] == report["kind"] and banner["verdict"] == report["verdict"]
    assert (
        f"msmon: kind of fault: one rank: its data or its device (step {NAN_STEP}, rank 1, first module fc1) "
        "[one_rank_data_or_device]; rank 1: its data or its device"
    ) in proc.stderr


@pytest.mark.e2e
def test_the_same_bad_batch_on_every_rank_is_all_ranks_together(tmp_path):
    proc = msmon_run(
        tmp_path,
        2,
        NAN_CONFIG,
        "rank_outlier_ddp.py",
        "--steps",
        str(NAN_STEP + 2),
        "--nan-batch-step",
        str(NAN_STEP),
        "--out",
        str(tmp_path),
    )
    records = dump_records(tmp_path)
    for rank in (0, 1):  # each rank's own forward met it: the input of its first module
        (origin,) = [r for r in records[rank] if r["rule"] == "NanOrigin" and r["step"] == NAN_STEP]
        assert (origin["name"], origin["category"]) == ("fc1.input", "actv")
    text, report, banner = read_back(tmp_path)
    assert (
        f"Kind: all ranks together: every rank (2) turned at step {NAN_STEP} in its own rank-local values "
        "(first: forward input of fc1 on rank 0)"
    ) in text
    assert_kind(report["kind"], "all_ranks", None, NAN_STEP, "fc1")
    assert report["kind"]["ranks"] == [0, 1]
    assert banner["kind"] == report["kind"]
    assert f"msmon: kind of fault: all ranks together (step {NAN_STEP}, first module fc1) [all_ranks]" in proc.stderr


@pytest.mark.e2e
def test_two_ranks_name_the_rank_fed_inputs_scaled_by_40_at_that_step_first_with_no_alarm_before(tmp_path):
    proc = msmon_run(
        tmp_path,
        2,
        OUTLIER_CONFIG,
        "rank_outlier_ddp.py",
        "--steps",
        str(SCALE_STEPS),
        "--bad-rank",
        "1",
        "--bad-step",
        str(SCALE_STEP),
        "--scale",
        "40",
        "--out",
        str(tmp_path),
    )
    truth = [json.loads((tmp_path / f"truth_rank{r}.json").read_text()) for r in range(2)]
    assert all(math.isfinite(loss) for t in truth for loss in t["loss"])  # scaled, never non-finite
    for rank in (0, 1):
        assert f"msmon[rank {rank}]: AnomalyRankOutlier compares data-parallel ranks [0, 1] every recorded step" in (
            proc.stderr
        )
    records = dump_records(tmp_path)
    assert list(records) == [1], records.get(0)  # nothing on rank 0, nothing before step 9
    steps = [r["step"] for r in records[1]]
    assert steps[0] == SCALE_STEP and min(steps) == SCALE_STEP
    first = records[1][0]
    assert (first["rule"], first["basis"], first["category"], first["op"], first["name"]) == (
        "AnomalyRankOutlier",
        "own_history",
        "actv",
        "actv_norm",
        "fc1.input",  # the first tensor that left its own history, in forward order: the scaled input
    )
    assert first["value"] / first["history"] > 10 and first["score"] > first["threshold"] == 5
    # the repeats of the rule on the same statistic: one line, and one count at the close
    assert proc.stderr.count("msmon alert [rank 1] step ") == 1
    assert re.search(
        r"msmon alert \[rank 1\] AnomalyRankOutlier on rank 1's activation norm: alerted in \d+ steps, "
        rf"{SCALE_STEP} to \d+ \(the first one logged; all in the anomaly dump\)",
        proc.stderr,
    ), proc.stderr[-3000:]

    text, report, banner = read_back(tmp_path)
    assert f"First anomaly: rank 1, step {SCALE_STEP}, forward input of fc1 (rank 1's activation norm" in text
    assert (
        f"Kind: one rank's data: rank 1's rank-local statistics left the other ranks' at step {SCALE_STEP}, first at "
        "the forward input of fc1"
    ) in text
    assert_kind(report["kind"], "one_rank_data", 1, SCALE_STEP, "fc1")
    assert banner["kind"] == report["kind"]
    assert f"msmon: kind of fault: one rank's data (step {SCALE_STEP}, rank 1, first module fc1) [one_rank_data]" in (
        proc.stderr
    )

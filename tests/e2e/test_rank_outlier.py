"""AnomalyRankOutlier end to end: 4 gloo ranks under real torchrun (`msmon run`), each drawing
its own batches through a model with dropout and gradient clipping; from step 7 on rank 2's
inputs are scaled by 30 (no NaN, the loss stays finite). The truth is what the script computed
itself (its per-step loss and input norm, saved per rank)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest
from test_replica_check import clean_env, dump_records, msmon_run

RANKS, BAD_RANK, BAD_STEP, STEPS = 4, 2, 7, 11
CONFIG = {
    "xy_distribution": True,
    "wg_distribution": True,
    "ops": ["norm", "min", "max", "nans"],
    "format": "csv",
    "alert": {"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyRankOutlier"}], "dump": True},
}


@pytest.mark.e2e
def test_the_rank_fed_corrupted_batches_is_named_first_at_that_step_as_one_ranks_data(tmp_path):
    proc = msmon_run(
        tmp_path,
        RANKS,
        CONFIG,
        "rank_outlier_ddp.py",
        "--steps",
        str(STEPS),
        "--bad-rank",
        str(BAD_RANK),
        "--bad-step",
        str(BAD_STEP),
        "--out",
        str(tmp_path),
    )
    truth = [json.loads((tmp_path / f"truth_rank{r}.json").read_text()) for r in range(RANKS)]
    assert all(math.isfinite(loss) for t in truth for loss in t["loss"])  # corrupted, never non-finite
    for rank in range(RANKS):
        assert f"msmon[rank {rank}]: AnomalyRankOutlier compares data-parallel ranks [0, 1, 2, 3]" in proc.stderr

    # no alarm on the healthy steps of any rank (dropout, clipping, each rank its own data), nor
    # on the healthy ranks afterwards: only rank 2, at every step from 7 on
    records = dump_records(tmp_path)
    assert list(records) == [BAD_RANK]
    assert [r["step"] for r in records[BAD_RANK]] == list(range(BAD_STEP, STEPS))
    first = records[BAD_RANK][0]
    assert (first["rule"], first["stage"], first["category"], first["op"]) == (
        "AnomalyRankOutlier",
        "forward",
        "actv",
        "actv_norm",
    )
    # the first tensor where it departs, in forward order: the corrupted input itself, whose
    # norm is the one the script computed on rank 2 (and the median that of every rank's)
    assert first["name"] == "fc1.input"
    tensor = first["tensor"]
    norms = [truth[r]["input_norm"][BAD_STEP] for r in range(RANKS)]
    assert tensor["value"] == pytest.approx(norms[BAD_RANK], rel=1e-5)
    assert tensor["median"] == pytest.approx(statistics.median(norms), rel=1e-5)
    assert first["group_ranks"] == [0, 1, 2, 3] and first["score"] > first["threshold"] == 5
    assert [a["statistic"] for a in first["also"]] == ["gradient norm"]  # its gradient departs too

    analysed = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "analyse", "-d", str(tmp_path / "out" / "anomaly_detected")],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert analysed.returncode == 0, analysed.stderr
    assert "First anomaly: rank 2, step 7, forward input of fc1" in analysed.stdout
    assert "Kind: one rank's data: rank 2's rank-local statistics left the other ranks' spread at step 7" in (
        analysed.stdout
    )
    report = json.loads((tmp_path / "out" / "anomaly_detected" / "msmon_analyse.json").read_text())
    assert (report["first_anomaly"]["rank"], report["first_anomaly"]["step"]) == (BAD_RANK, BAD_STEP)
    assert (report["kind"]["code"], report["kind"]["kind"], report["kind"]["rank"], report["kind"]["step"]) == (
        "one_rank_data",
        "one rank's data",
        BAD_RANK,
        BAD_STEP,
    )

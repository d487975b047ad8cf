"""Under DDP, grad_unreduced is the rank-local accumulated gradient and grad_reduced the averaged one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ALL_OPS, ROOT, assert_row_matches, rank_dir, read_csv_rows, reference_stats
from msmon.offline.analyse.reading import read_dumps
from msmon.offline.analyse.verdict import first_per_rank, order_events, verdict


@pytest.mark.e2e
def test_unreduced_is_rank_local_and_reduced_is_the_all_reduced_mean(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"wg_distribution": True, "format": "csv", "ops": ALL_OPS}))  # every op of the table
    out = tmp_path / "out"
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(ROOT / "tests" / "scripts" / "core_ddp_grads.py"),
        str(config),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        truth = torch.load(tmp_path / f"truth_rank{rank}.pt")
        directory = rank_dir(out, rank)
        unreduced = read_csv_rows(directory, "grad_unreduced")
        reduced = read_csv_rows(directory, "grad_reduced")
        assert len(unreduced) == len(reduced) == 2 * 4
        for row in unreduced:
            assert_row_matches(row, reference_stats(truth[int(row["step"])]["local"][row["name"]]))
        for row in reduced:
            assert_row_matches(row, reference_stats(truth[int(row["step"])]["reduced"][row["name"]]))
    # the two ranks saw different data: their local gradients differ, the reduced ones agree
    r0 = {(r["step"], r["name"]): r["norm"] for r in read_csv_rows(rank_dir(out, 0), "grad_unreduced")}
    r1 = {(r["step"], r["name"]): r["norm"] for r in read_csv_rows(rank_dir(out, 1), "grad_unreduced")}
    assert r0 != r1
    g0 = {(r["step"], r["name"]): r["norm"] for r in read_csv_rows(rank_dir(out, 0), "grad_reduced")}
    g1 = {(r["step"], r["name"]): r["norm"] for r in read_csv_rows(rank_dir(out, 1), "grad_reduced")}
    assert g0 == g1


def run_accumulation(tmp_path, config: dict, *args: str) -> Path:
    """tests/scripts/ddp_accumulation.py on 2 gloo ranks; returns the output directory."""
    config_path = tmp_path / "monitor.json"
    config_path.write_text(json.dumps(config))
    out = tmp_path / "out"
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(ROOT / "tests" / "scripts" / "ddp_accumulation.py"),
        str(config_path),
        str(tmp_path),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / "stderr.txt").write_text(proc.stderr)
    return out


OPS = ["norm", "min", "max", "mean", "nans"]


@pytest.mark.e2e
@pytest.mark.parametrize("mode, extra", [("sync", "infer"), ("sync", "inner"), ("no_sync", "known")])
def test_unreduced_is_the_rank_local_accumulation_whether_or_not_ddp_reduces_each_micro_batch(tmp_path, mode, extra):
    """Three micro-batches per step; `sync`: DDP all-reduces every one of them (no no_sync()).
    `infer`: grad_acc_steps is counted in step 0; `inner`: the monitor sees the bare model, DDP
    wraps it afterwards (found among live objects)."""
    out = run_accumulation(tmp_path, {"wg_distribution": True, "format": "csv", "ops": OPS}, mode, "3", "3", "-", extra)
    for rank in (0, 1):
        truth = torch.load(tmp_path / f"truth_rank{rank}.pt")
        directory = rank_dir(out, rank)
        unreduced, reduced = read_csv_rows(directory, "grad_unreduced"), read_csv_rows(directory, "grad_reduced")
        assert len(unreduced) == len(reduced) == 3 * 4
        for row in unreduced:  # the local sum over the step's three micro-batches, as plain autograd has it
            assert_row_matches(row, reference_stats(truth["steps"][int(row["step"])]["micro"][-1][row["name"]], OPS))
        for row in reduced:
            assert_row_matches(row, reference_stats(truth["steps"][int(row["step"])]["reduced"][row["name"]], OPS))
        # with no_sync the gradient is read where it lies; reduced micro-batches cost one copy per parameter
        assert truth["copies"] == (0 if mode == "no_sync" else 4)


@pytest.mark.e2e
def test_per_micro_batch_rows_are_rank_local_under_ddp_without_no_sync(tmp_path):
    out = run_accumulation(
        tmp_path,
        {"wg_distribution": True, "monitor_mbs_grad": True, "format": "csv", "ops": OPS},
        "sync",
        "3",
        "2",
        "-",
        "bucket_view",
    )
    for rank in (0, 1):
        truth = torch.load(tmp_path / f"truth_rank{rank}.pt")
        rows = read_csv_rows(rank_dir(out, rank), "grad_unreduced")
        assert {(r["step"], r["micro_step"]) for r in rows} == {(s, m) for s in "01" for m in "012"}
        for row in rows:  # after micro-batch k: the local sum of micro-batches 0..k
            expected = truth["steps"][int(row["step"])]["micro"][int(row["micro_step"])][row["name"]]
            assert_row_matches(row, reference_stats(expected, OPS))


@pytest.mark.e2e
def test_a_gradient_the_script_reduces_itself_between_micro_batches_is_left_out_not_misreported(tmp_path):
    out = run_accumulation(tmp_path, {"wg_distribution": True, "format": "csv", "ops": OPS}, "manual", "2", "2")
    for rank in (0, 1):
        directory = rank_dir(out, rank)
        assert read_csv_rows(directory, "grad_unreduced") == []
        assert len(read_csv_rows(directory, "grad_reduced")) == 2 * 4
    log = (tmp_path / "stderr.txt").read_text()
    assert log.count("was rewritten in place between micro-batches") == 2  # once per rank


@pytest.mark.e2e
def test_a_nan_on_one_rank_is_blamed_on_that_rank_and_raises_no_unreduced_alert_on_the_healthy_one(tmp_path):
    """Rank 1's loss turns NaN in micro-batch 0 of step 2; DDP all-reduces it into rank 0's `.grad`."""
    out = run_accumulation(
        tmp_path,
        {
            "wg_distribution": True,
            "format": "csv",
            "ops": OPS,
            "nan_origin": False,
            "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
        },
        "sync",
        "2",
        "3",
        "2",
    )
    dumps = out / "anomaly_detected"
    records = {
        rank: [json.loads(line) for line in (dumps / f"rank{rank}" / "anomaly.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    }
    assert {r["category"] for r in records[0]} == {"grad_reduced"}  # rank 0's own gradient stayed finite
    assert {r["category"] for r in records[1]} == {"grad_unreduced", "grad_reduced"}
    assert {r["step"] for r in records[0] + records[1]} == {2}
    ordered = order_events(read_dumps(str(dumps)).events)  # what `msmon analyse` orders and reports
    first = ordered[0]
    assert (first.rank, first.step, first.category, first.stage) == (1, 2, "grad_unreduced", "backward")
    assert verdict(ordered).startswith("First anomaly: rank 1, step 2, unreduced gradient of")
    assert first_per_rank(ordered)[0].category == "grad_reduced"


@pytest.mark.e2e
@pytest.mark.parametrize("mode, mbs", [("no_sync", False), ("no_sync", True), ("sync", False)])
def test_unreduced_survives_every_step_when_bucket_view_gradients_are_zeroed_in_place(tmp_path, mode, mbs):
    """gradient_as_bucket_view=True with zero_grad(set_to_none=False): `.grad` is one view into
    DDP's bucket for the whole run (all of a bucket's gradients share its version counter),
    zeroed in place between steps. `no_sync`: two micro-batches accumulate under no_sync() and
    the third is reduced; `sync`: every micro-batch is reduced."""
    config = {"wg_distribution": True, "monitor_mbs_grad": mbs, "format": "csv", "ops": OPS}
    out = run_accumulation(tmp_path, config, mode, "3", "3", "-", "bucket_view", "keep_grads")
    for rank in (0, 1):
        truth = torch.load(tmp_path / f"truth_rank{rank}.pt")
        directory = rank_dir(out, rank)
        unreduced, reduced = read_csv_rows(directory, "grad_unreduced"), read_csv_rows(directory, "grad_reduced")
        assert len(unreduced) == (3 if mbs else 1) * 3 * 4 and len(reduced) == 3 * 4
        for row in unreduced:  # the local sum up to that micro-batch (the step's last one), as plain autograd has it
            micro = int(row["micro_step"]) if mbs else -1
            expected = truth["steps"][int(row["step"])]["micro"][micro][row["name"]]
            assert_row_matches(row, reference_stats(expected, OPS))
        for row in reduced:
            assert_row_matches(row, reference_stats(truth["steps"][int(row["step"])]["reduced"][row["name"]], OPS))
    assert "rewritten in place" not in (tmp_path / "stderr.txt").read_text()


@pytest.mark.e2e
def test_on_the_accelerator_path_bucket_view_gradients_are_read_in_place_with_the_same_values(tmp_path, monkeypatch):
    """MSMON_DEVICE_PATH=1: DDP's bucket (gradient_as_bucket_view) is one storage, read as one span
    by the compiled pass; every row equals the script's own gradients."""
    monkeypatch.setenv("MSMON_DEVICE_PATH", "1")
    config = {"wg_distribution": True, "format": "csv", "ops": OPS}
    out = run_accumulation(tmp_path, config, "sync", "3", "3", "-", "bucket_view", "keep_grads")
    for rank in (0, 1):
        truth = torch.load(tmp_path / f"truth_rank{rank}.pt")
        directory = rank_dir(out, rank)
        unreduced, reduced = read_csv_rows(directory, "grad_unreduced"), read_csv_rows(directory, "grad_reduced")
        assert len(unreduced) == len(reduced) == 3 * 4
        for row in unreduced:
            assert_row_matches(row, reference_stats(truth["steps"][int(row["step"])]["micro"][-1][row["name"]], OPS))
        for row in reduced:
            assert_row_matches(row, reference_stats(truth["steps"][int(row["step"])]["reduced"][row["name"]], OPS))
    assert "compiled statistics pass is off" not in (tmp_path / "stderr.txt").read_text()

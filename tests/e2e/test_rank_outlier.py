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
from pathlib import Path

import pytest
import torch
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
    # named at every step from 7: one line at the first, and at the close one count (not a line a step)
    assert proc.stderr.count("msmon alert [rank 2] step ") == 1
    assert (
        f"msmon alert [rank 2] AnomalyRankOutlier on rank 2's activation norm: alerted in {STEPS - BAD_STEP} steps, "
        f"{BAD_STEP} to {STEPS - 1} (the first one logged; all in the anomaly dump)"
    ) in proc.stderr
    for rank in range(RANKS):  # summary.json counts the rule's alerts with the others'
        (summary,) = (tmp_path / "out").glob(f"*-rank{rank}-*/summary.json")
        assert json.loads(summary.read_text())["alerts"] == (STEPS - BAD_STEP if rank == BAD_RANK else 0)

    analysed = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "analyse", "-d", str(tmp_path / "out" / "anomaly_detected")],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert analysed.returncode == 0, analysed.stderr
    assert "First anomaly: rank 2, step 7, forward input of fc1" in analysed.stdout
    assert (
        "Kind: one rank's data: rank 2's rank-local statistics left the other ranks' at step 7, first at the forward "
        "input of fc1"
    ) in analysed.stdout
    report = json.loads((tmp_path / "out" / "anomaly_detected" / "msmon_analyse.json").read_text())
    assert (report["first_anomaly"]["rank"], report["first_anomaly"]["step"]) == (BAD_RANK, BAD_STEP)
    assert (report["kind"]["code"], report["kind"]["kind"], report["kind"]["rank"], report["kind"]["step"]) == (
        "one_rank_data",
        "one rank's data",
        BAD_RANK,
        BAD_STEP,
    )


# -- the loss joins with loss_distribution, read from its rows ------------------------------------
LOSS_RANKS, LOSS_RANK, LOSS_STEP, LOSS_STEPS = 3, 1, 4, 7


def _loss_rank(rank: int, tmp: str) -> None:
    """One rank of a 3-rank DDP job using the API, two micro-steps a step (no_sync on the
    first), with loss_distribution recording each micro-step's loss. From step 4 on rank 1 adds
    100 to its loss: its gradients are unchanged, only its loss departs. Every device-to-host
    copy msmon starts is counted (runtime/transfer.py's one function that starts them)."""
    import os

    import torch.distributed as dist

    from msmon import TrainerMon
    from msmon.runtime import transfer

    copies = [0]
    to_host = transfer._to_host

    def counted(t, events):
        copies[0] += 1
        return to_host(t, events)

    transfer._to_host = counted

    os.environ["MONITOR_OUTPUT_DIR"] = f"{tmp}/out"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=LOSS_RANKS)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TrainerMon(f"{tmp}/monitor.json")
    monitor.set_monitor(model, optimizer, grad_acc_steps=2)
    gen = torch.Generator().manual_seed(10 + rank)
    means = []
    for step in range(LOSS_STEPS):
        losses = []
        for micro in range(2):
            x = torch.randn(64, 6, generator=gen)
            loss = model(x).pow(2).mean() + (100.0 if rank == LOSS_RANK and step >= LOSS_STEP else 0.0)
            if micro == 0:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            losses.append(loss.item())
        means.append(sum(losses) / 2)
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    (Path(tmp) / f"means_rank{rank}.json").write_text(json.dumps({"means": means, "copies": copies[0]}))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_a_rank_whose_loss_alone_departs_is_named_by_its_mean_loss_read_from_the_steps_one_copy(tmp_path):
    import torch.multiprocessing as mp

    config = {
        "loss_distribution": True,  # the rule's loss is the mean of these rows: no loss without them
        "wg_distribution": True,
        "ops": ["norm"],
        "format": "csv",
        "alert": {"rules": [{"rule_name": "AnomalyRankOutlier"}], "dump": True},
    }
    (tmp_path / "monitor.json").write_text(json.dumps(config))
    mp.spawn(_loss_rank, args=(str(tmp_path),), nprocs=LOSS_RANKS, join=True)
    saved = [json.loads((tmp_path / f"means_rank{r}.json").read_text()) for r in range(LOSS_RANKS)]
    means = [s["means"] for s in saved]
    # one device-to-host copy per step on every rank: the rule reads the loss from the step's rows
    # (it made a second one, of the mean loss, before)
    assert [s["copies"] for s in saved] == [LOSS_STEPS] * LOSS_RANKS
    records = dump_records(tmp_path)
    assert list(records) == [LOSS_RANK]
    assert [r["step"] for r in records[LOSS_RANK]] == list(range(LOSS_STEP, LOSS_STEPS))
    for record in records[LOSS_RANK]:
        step = record["step"]
        assert (record["name"], record["category"], record["op"], record["statistic"]) == (
            "loss",
            "loss",
            "loss",
            "loss",
        )
        assert record["also"] == []  # its gradients are those of the other ranks' kind
        # the mean of the two micro-steps' losses, as the script computed them
        assert record["value"] == pytest.approx(means[LOSS_RANK][step], rel=1e-6)
        assert record["rank_values"] == pytest.approx({str(r): means[r][step] for r in range(LOSS_RANKS)}, rel=1e-6)

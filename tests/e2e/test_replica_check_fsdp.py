"""The replica check under FSDP: HSDP's shards are compared across their replicate group.

Under HSDP every parameter is split across a shard group and each piece copied across a
replicate group (the ranks holding the same shard index): each rank's local piece must be
bit-identical across its replicate group. Real torchrun (via `msmon run`), gloo, CPU, with
tests/scripts/fsdp_replica_flip.py, which knows nothing of the monitor; the truth is the local
pieces each rank saved at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_replica_check import CHECK, clean_env, dump_records, msmon_run, reports

from msmon.collectors.replica_check.entries import GRAD, WEIGHT

PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def differing_pieces(work: Path, ranks: int, classes: list[list[int]]) -> dict[str, set[int]]:
    """From the local pieces the ranks saved (the independent truth): each tensor whose pieces
    differ within a replicate class, with the ranks of that class."""
    saved = [torch.load(work / f"pieces_rank{r}.pt") for r in range(ranks)]
    out: dict[str, set[int]] = {}
    for name in saved[0]:
        for members in classes:
            if any(not torch.equal(saved[r][name], saved[members[0]][name]) for r in members[1:]):
                out.setdefault(name, set()).update(members)
    return out


def flip_run(tmp_path: Path, mode: str, flip_rank: int, grads: bool) -> subprocess.CompletedProcess:
    """4 ranks, 2 replicas x 2 shards; `flip_rank` flips bit 20 of element 3 of its piece of
    fc1.weight at the start of step 3; checks every 2 steps: 0, 2 (clean), 4 (names it)."""
    return msmon_run(
        tmp_path,
        4,
        {**CHECK, "replica_check": {"enable": True, "every": 2, "grads": grads}},
        "fsdp_replica_flip.py",
        "--mode",
        mode,
        "--steps",
        "6",
        "--flip-step",
        "3",
        "--flip-rank",
        str(flip_rank),
        "--out",
        str(tmp_path),
    )


def assert_pair_named(tmp_path: Path, proc: subprocess.CompletedProcess, pair: list[int], grads: bool) -> None:
    """Only `pair` (the flipping rank's replicate class) reports fc1.weight's shard at step 4,
    both ranks of it (two replicas: no majority); the other class stays clean throughout."""
    classes = [[0, 2], [1, 3]]
    assert differing_pieces(tmp_path, 4, classes) == {"fc1.weight": set(pair)}
    checked = [
        {"name": n, "vpp_stage": 0, "category": c, "shard": True} for c in [GRAD] * grads + [WEIGHT] for n in PARAMS
    ]
    for rank, report in enumerate(reports(tmp_path, 4)):
        own = next(c for c in classes if rank in c)
        assert report["group_ranks"] == own and report["checks"] == 3 and report["off"] is None  # steps 0, 2, 4
        assert report["checked"] == checked and report["skipped"] == []
        if rank not in pair:
            assert report["mismatches"] == []
            continue
        assert report["mismatches"] == [
            {
                "step": 4,
                "tensors": [
                    {
                        "name": "fc1.weight",
                        "vpp_stage": 0,
                        "category": WEIGHT,
                        "differing_ranks": pair,
                        "majority_ranks": [],
                        "shard": True,
                    }
                ],
            }
        ]
        line = (
            f"msmon[rank {rank}]: replica check at step 4: 1 of {len(checked)} tensors differ across data-parallel "
            f"ranks {pair[0]}, {pair[1]}: fc1.weight (this rank's shard; weight after the update): ranks "
            f"{pair[0]}, {pair[1]} hold different copies and none has a majority"
        )
        assert line in proc.stderr
    records = dump_records(tmp_path)
    assert sorted(records) == pair  # with two replicas both copies are suspect
    for rank in pair:
        (record,) = records[rank]
        assert (record["step"], record["name"], record["category"], record["rule"]) == (
            4,
            "fc1.weight",
            WEIGHT,
            "ReplicaMismatch",
        )
        assert (record["differing_ranks"], record["majority_ranks"], record["group_ranks"]) == (pair, [], pair)
    analysed = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "analyse", "-d", str(tmp_path / "out" / "anomaly_detected")],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert analysed.returncode == 0, analysed.stderr
    assert "step 4, weight fc1.weight after the update (copies differ across data-parallel replicas" in analysed.stdout
    assert (
        f"found fc1.weight (this rank's shard; weight after the update): ranks {pair[0]}, {pair[1]} hold different "
        "copies" in analysed.stdout
    )


@pytest.mark.e2e
def test_hsdp_names_the_replicate_pair_whose_shard_had_a_bit_flipped(tmp_path):
    """FSDP2 on a (replicate 2, shard 2) mesh; rank 2 flips: ranks 0 and 2 hold shard 0."""
    proc = flip_run(tmp_path, "hsdp", flip_rank=2, grads=True)
    assert_pair_named(tmp_path, proc, [0, 2], grads=True)


@pytest.mark.e2e
def test_fsdp1_hybrid_shard_names_the_replicate_pair_whose_shard_had_a_bit_flipped(tmp_path):
    """FSDP1 HYBRID_SHARD on the same mesh (use_orig_params); rank 1 flips: ranks 1 and 3 hold shard 1."""
    proc = flip_run(tmp_path, "fsdp1-hybrid", flip_rank=1, grads=False)
    assert_pair_named(tmp_path, proc, [1, 3], grads=False)


@pytest.mark.e2e
def test_fsdp1_no_shard_units_are_checked_whole_with_no_false_alarm(tmp_path):
    msmon_run(
        tmp_path,
        2,
        {**CHECK, "replica_check": {"enable": True, "every": 2, "grads": True}},
        "fsdp_replica_flip.py",
        "--mode",
        "fsdp1-noshard",
        "--steps",
        "6",
        "--out",
        str(tmp_path),
    )
    for report in reports(tmp_path, 2):
        assert report["group_ranks"] == [0, 1] and report["checks"] == 3 and report["off"] is None
        assert report["checked"] == [{"name": n, "vpp_stage": 0, "category": c} for c in (GRAD, WEIGHT) for n in PARAMS]
        assert report["skipped"] == [] and report["mismatches"] == []
    assert dump_records(tmp_path) == {}


@pytest.mark.e2e
def test_plain_fsdp2_skips_every_shard_and_says_why(tmp_path):
    """A 1-D mesh: each rank's piece exists once, nothing has a replica; the check is off."""
    msmon_run(
        tmp_path,
        2,
        {**CHECK, "replica_check": {"enable": True, "every": 2, "grads": True}},
        "fsdp_replica_flip.py",
        "--mode",
        "fsdp2",
        "--steps",
        "3",
        "--out",
        str(tmp_path),
    )
    why = (
        "this rank's shard: FSDP splits it across ranks 0, 1 and no other rank holds a copy of this piece "
        "(no replicate dimension, as HSDP has)"
    )
    for report in reports(tmp_path, 2):
        assert report["off"].startswith("no tensor has a copy on another rank") and report["checks"] == 0
        assert report["checked"] == [] and report["mismatches"] == []
        assert report["skipped"] == [
            {"name": n, "vpp_stage": 0, "category": c, "why": why} for c in (GRAD, WEIGHT) for n in PARAMS
        ]

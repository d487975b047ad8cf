"""The exit drain (src/msmon/system/exit_drain.py) on a real 2-rank gloo group: it waits for the
collectives it holds, gives up on one the other rank never joins (and keeps it), and releases
msmon's own group; msmon's own collectives (agreement rounds, the replica check's exchange,
the sharded statistics' gather) are held for it."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _gather(rank: int) -> tuple[object, list[torch.Tensor]]:
    payload = torch.full((1 << 16,), float(rank + 1))
    parts = [torch.empty_like(payload) for _ in range(2)]
    return dist.all_gather(parts, payload, async_op=True), parts


def _rank(rank: int, tmp: str) -> None:
    from msmon.collectors.replica_check.group import exchange, own_group
    from msmon.runtime import agreement
    from msmon.runtime.shards import _all_gather
    from msmon.system import exit_drain

    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=2)
    signals = dist.FileStore(f"{tmp}/signals", 2)
    signals.set_timeout(timedelta(seconds=120))
    out: dict[str, object] = {}
    if rank == 0:
        never_joined, _ = _gather(rank)  # rank 1 joins only after the drain below gave up on it
        exit_drain.hold(never_joined)
        out["gave_up"] = exit_drain.drain(seconds=0.2)
        out["gave_up_completed"] = never_joined.is_completed()
        signals.set("gave_up", "1")
        late, parts = _gather(rank)  # rank 1 joins it while the drain below is waiting
        exit_drain.hold(late)
        signals.set("draining", "1")
        out["waited"] = exit_drain.drain(seconds=120)
        out["late_completed"] = late.is_completed()
        out["late_values"] = [float(p[0]) for p in parts] + [float(p[-1]) for p in parts]
    else:
        signals.wait(["gave_up"])
        _gather(rank)[0].wait()
        signals.wait(["draining"])
        time.sleep(0.5)  # rank 0 is inside the drain by now (if not, the drain finds it done)
        _gather(rank)[0].wait()
    rounds = agreement.ConfigAgreement([dist.group.WORLD], rank)
    rounds.end_round({})  # an agreement round: a one-number all_gather, not waited for
    out["agreement_held"] = exit_drain.held()
    out["agreement_drained"] = exit_drain.drain(seconds=120)
    group = own_group([0, 1])
    payload = torch.tensor([rank + 10, -rank], dtype=torch.int64)
    out["exchanged"] = exchange(payload, group, 2).tolist()  # the replica check's exchange
    out["combined"] = _all_gather(payload.double(), dist.group.WORLD).tolist()  # sharded statistics
    out["own_held"] = exit_drain.held()
    out["own_drained"] = exit_drain.drain(seconds=120)
    out["own_group_left"] = group in dist.distributed_c10d._world.pg_map
    exit_drain.track_process_groups()  # what `msmon run` does at start-up
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed)  # a sync collective of the script's: its Work is held all the same
    out["tracked_sum"] = float(summed[0])
    out["tracked_held"] = exit_drain.held()
    out["tracked_drained"] = exit_drain.drain(seconds=120)
    Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("exit_drain")
    mp.spawn(_rank, args=(str(tmp),), nprocs=2, join=True)
    return {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)}


def test_the_exit_drain_waits_for_a_held_collective_the_other_rank_joins_late(ranks):
    assert ranks[0]["waited"] == {"waited": 1, "unfinished": 0}
    assert ranks[0]["late_completed"] is True
    assert ranks[0]["late_values"] == [1.0, 2.0, 1.0, 2.0]  # each rank's fill, in rank order


def test_the_exit_drain_gives_up_at_its_deadline_and_keeps_the_unfinished_collective(ranks):
    assert ranks[0]["gave_up"] == {"waited": 1, "unfinished": 1}
    assert ranks[0]["gave_up_completed"] is False


def test_msmons_agreement_rounds_are_held_and_waited_at_exit(ranks):
    for rank in (0, 1):
        assert ranks[rank]["agreement_held"] == 1
        assert ranks[rank]["agreement_drained"] == {"waited": 1, "unfinished": 0}


def test_msmons_own_sync_gathers_are_held_until_exit_and_their_results_are_unchanged(ranks):
    for rank in (0, 1):
        assert ranks[rank]["exchanged"] == [[10, 0], [11, -1]]
        assert ranks[rank]["combined"] == [[10.0, 0.0], [11.0, -1.0]]
        assert ranks[rank]["own_held"] == 2  # finished, but not yet seen finished at a later collective
        assert ranks[rank]["own_drained"] == {"waited": 2, "unfinished": 0}


def test_msmons_own_replica_check_group_is_destroyed_at_exit(ranks):
    assert ranks[0]["own_group_left"] is False and ranks[1]["own_group_left"] is False


def test_under_msmon_run_a_scripts_sync_collective_is_held_for_the_exit_and_its_result_is_unchanged(ranks):
    for rank in (0, 1):
        assert ranks[rank]["tracked_sum"] == 3.0  # 1 + 2
        assert ranks[rank]["tracked_held"] == 1
        assert ranks[rank]["tracked_drained"] == {"waited": 1, "unfinished": 0}

"""The replica check's group: the data-parallel group of this rank's replicas, msmon's own
gloo group over its ranks, and the one all_gather of fingerprints through it. The rank
comparison (collectors/rank_outlier/) exchanges through a group of its own made here too."""

from __future__ import annotations

import gc
import inspect
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...runtime import dedupe
from ...system import exit_drain

if TYPE_CHECKING:
    from ...runtime.step_context import StepContext

GATHER_TIMEOUT = timedelta(minutes=10)
_OWN_GROUPS: dict[tuple, Any] = {}
EXCHANGES: list[Any] = []  # the states (with an `exchange`: runtime/exchange_thread.py) that use msmon's groups


def replica_group(ctx: StepContext) -> Any:
    """The data-parallel group of this rank's replicas, or None when none is known."""
    groups = dedupe.discover(ctx.models, ctx.adapter, ctx.frameworks, ctx.dp_group, ctx.tp_group)
    if groups.dp is not None:
        return groups.dp
    for p in ctx.adapter.params():  # the copies an adapter declares (FSDP1 NO_SHARD units)
        declared = ctx.adapter.replica_group(p)
        if declared is not None:
            return declared
    return _ddp_group(ctx)


def _ddp_group(ctx: StepContext) -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:
        return None
    owned = {id(p) for p in ctx.adapter.params()}
    for chunk in ctx.models:
        for m in chunk.modules():
            if isinstance(m, DDP):
                return getattr(m, "process_group", None) or dist.group.WORLD
    # the monitor may hold the bare model that DDP wrapped afterwards: look for that DDP once
    for obj in gc.get_objects():
        if issubclass(type(obj), DDP) and any(id(p) in owned for p in obj.parameters()):
            return getattr(obj, "process_group", None) or dist.group.WORLD
    return None


def own_group(ranks: list[int], purpose: str = "replica_check") -> Any:
    """msmon's own gloo group over `ranks` for one purpose (made once per purpose and set of
    ranks; only its members take part), so the exchange never queues behind the training's
    collectives or streams. Each purpose has its own group: two threads issuing collectives
    on one group could issue them in another order on each rank."""
    key = (id(dist.distributed_c10d._get_default_group()), purpose, tuple(ranks))
    group = _OWN_GROUPS.get(key)
    if group is None:
        options: dict[str, Any] = {"backend": "gloo", "timeout": GATHER_TIMEOUT, "use_local_synchronization": True}
        if "group_desc" in inspect.signature(dist.new_group).parameters:  # torch >= 2.3
            options["group_desc"] = f"msmon_{purpose}"
        group = _OWN_GROUPS[key] = dist.new_group(sorted(ranks), **options)
        exit_drain.at_drain(_release_own_groups)
    return group


def _release_own_groups() -> None:
    """At exit, while the interpreter is whole: destroy msmon's groups, unless an exchange is
    still on its way (a check the other ranks never joined keeps its group)."""
    if any(state.exchange.pending for state in EXCHANGES):
        return
    for state in EXCHANGES:
        state.group = None
    for key in list(_OWN_GROUPS):
        exit_drain.destroy_group(_OWN_GROUPS.pop(key))


def exchange(payload: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[size, len(payload)]: every member's payload, in group-rank order, by one all_gather
    through torch's own function (under cc_distribution msmon's wrapper would count msmon's
    exchange as the training's communication)."""
    gathered = [torch.empty_like(payload) for _ in range(size)]
    all_gather = getattr(dist.all_gather, "__msmon_original__", dist.all_gather)
    exit_drain.hold(all_gather(gathered, payload, group=group, async_op=True)).wait()  # held: exit_drain.py
    return torch.stack(gathered)

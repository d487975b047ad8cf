"""Who writes a replicated tensor: decided once per monitor, at attach time, never per step.

Data parallelism replicates weights, reduced gradients and optimizer state on every rank of a
data-parallel group; tensor parallelism replicates the parameters that are not split
(no `tensor_model_parallel` attribute) on every rank of a tensor-parallel group. Each such
tensor is written once: by the first rank of its data-parallel group and, unless split by
tensor parallelism, the first rank of its tensor-parallel group. A parameter split across
ranks (a Shard) is written by the first rank of the group it is split across, and the same
tensor-parallel rule. Rank-local gradients (before the reduction) differ and stay per rank.

The groups come from what the job says, in this order: the `dp_group` / `tp_group` given to
set_monitor, the optimizer itself (DeepSpeed's dp_process_group, Megatron's distributed
optimizer), what the models handed over say (a DeepSpeed engine), what the process's parallel
state says (Megatron's `parallel_state`). The last two are each framework's own knowledge, asked
of its package (`hooks/<framework>/groups.py`: `groups_of_models`, then `groups_of_process`).
Plain DDP without a `dp_group` is not deduplicated (msprobe's behaviour: every rank writes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ..seams.parallel_groups import ParallelGroups
from ..system.distributed import current_rank, is_initialized

if TYPE_CHECKING:
    from ..seams.spec import Framework
    from .step_context import StepContext

logger = logging.getLogger("msmon")


def discover(
    models: list[torch.nn.Module],
    adapter: Any,
    frameworks: Sequence[Framework],
    dp_group: Any = None,
    tp_group: Any = None,
) -> ParallelGroups:
    """The data-, tensor- and pipeline-parallel groups of this rank, without being told.
    `frameworks`: the framework packages (hooks.frameworks(), passed down by the api), each
    asked through its optional `groups_of_models` and `groups_of_process`."""
    found = ParallelGroups(dp=dp_group, tp=tp_group, source="set_monitor arguments" if dp_group or tp_group else "none")
    if not is_initialized():
        return found
    if found.dp is None and adapter is not None and adapter.data_parallel_group() is not None:
        found.dp, found.source = adapter.data_parallel_group(), "the optimizer"
    for framework in frameworks:  # what the models say, before the process's state
        if framework.groups_of_models is not None:
            framework.groups_of_models(found, models, adapter)
    for framework in frameworks:
        if framework.groups_of_process is not None:
            framework.groups_of_process(found)
    return found


def written_elsewhere(groups: ParallelGroups, adapter: Any) -> frozenset[int]:
    """id() of the parameters whose weight, reduced gradient and optimizer state another rank
    writes. Evaluated here, for every parameter of the optimizer, and frozen into a set."""
    first_tp = _is_first(groups.tp)
    first_dp = _is_first(groups.dp)
    decided: dict[int, bool] = {}
    for p in adapter.params():
        split = adapter.shard_group(p)
        first = _is_first(split) if split is not None else (first_dp or _is_dtensor(p))
        if split is not None:  # HSDP: split across one group, copied across another
            first = first and _is_first(adapter.replica_group(p))
        decided[id(p)] = first and (first_tp or bool(getattr(p, "tensor_model_parallel", False)))
    return frozenset(key for key, writes in decided.items() if not writes)


def shards_complete(adapter: Any, module_ranks: list[int]) -> bool:
    """Whether every rank holding a piece of a split parameter records (module_ranks lets some
    ranks record nothing; then the pieces cannot be combined)."""
    if not module_ranks or not is_initialized():
        return True
    active = set(module_ranks)
    for group in adapter.shard_groups():
        missing = sorted(set(dist.get_process_group_ranks(group)) - active)
        if missing:
            logger.warning(
                "msmon[rank %d]: module_ranks leaves out ranks %s, which hold pieces of the sharded weights, "
                "gradients and optimizer state; those are not recorded",
                current_rank(),
                missing,
            )
            return False
    return True


def _is_first(group: Any) -> bool:
    if group is None or not is_initialized():
        return True
    try:
        return dist.get_rank(group=group) == 0
    except Exception:  # not a member: nothing to deduplicate against
        return True


def replica_exclusion(
    models: list[torch.nn.Module], optimizer: Any, weights: bool, frameworks: Sequence[Framework]
) -> Callable[[torch.Tensor], str | None]:
    """Why a model parameter's weight (`weights`) or reduced gradient is not the same tensor on
    every rank of its data-parallel group (None: it is a replica), for the replica check. A
    DTensor is each rank's own shard; the framework packages add what their frameworks split or
    update late (their `replica_exclusion`; `frameworks` as for `discover`)."""
    rules = [
        rule
        for framework in frameworks
        if framework.replica_exclusion is not None
        for rule in [framework.replica_exclusion(models, optimizer, weights)]
        if rule is not None
    ]

    def why(param: torch.Tensor) -> str | None:
        if _is_dtensor(param):
            return "a DTensor (FSDP2): each rank holds its own shard"
        for rule in rules:
            reason = rule(param)
            if reason is not None:
                return reason
        return None

    return why


def _is_dtensor(param: torch.Tensor) -> bool:
    """FSDP2 parameters: each rank holds a different shard, never a replica."""
    return callable(getattr(param, "to_local", None))


def decide_writers(
    ctx: StepContext, frameworks: Sequence[Framework], dp_group: Any = None, tp_group: Any = None
) -> bool:
    """Decide, once, what this rank writes (frozen into the adapter of `ctx`); return whether
    the pieces of split tensors can be combined (the monitor's ShardCombiner is enabled)."""
    adapter = ctx.adapter
    groups = discover(ctx.models, adapter, frameworks, dp_group, tp_group)
    ctx.parallel = groups.sizes()
    adapter.written_elsewhere = written_elsewhere(groups, adapter)
    written = sum(id(p) not in adapter.written_elsewhere for p in adapter.params())
    logger.debug(
        "msmon[rank %d]: %s optimizer, %s; this rank writes %d of %d parameters' weights, gradients and moments",
        current_rank(),
        adapter.family,
        groups.describe(),
        written,
        len(adapter.params()),
    )
    return shards_complete(adapter, ctx.config.module_ranks)

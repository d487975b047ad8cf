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
optimizer), a DeepSpeed engine among the models, Megatron's `parallel_state`. Plain DDP without
a `dp_group` is not deduplicated (msprobe's behaviour: every rank writes).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .distributed import current_rank, is_initialized

logger = logging.getLogger("msmon")


@dataclass
class ParallelGroups:
    """The process groups found for one monitor, with where each came from."""

    dp: Any = None
    tp: Any = None
    pp: Any = None
    source: str = "none"

    def describe(self) -> str:
        sizes = ", ".join(
            f"{name}={_size(group)}"
            for name, group in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp))
            if group is not None
        )
        return f"{sizes or 'no parallel groups'} (from {self.source})"


def discover(models: list[torch.nn.Module], adapter: Any, dp_group: Any = None, tp_group: Any = None) -> ParallelGroups:
    """The data-, tensor- and pipeline-parallel groups of this rank, without being told."""
    found = ParallelGroups(dp=dp_group, tp=tp_group, source="set_monitor arguments" if dp_group or tp_group else "none")
    if not is_initialized():
        return found
    if found.dp is None and adapter is not None and adapter.data_parallel_group() is not None:
        found.dp, found.source = adapter.data_parallel_group(), "the optimizer"
    engine = next((m for m in models if type(m).__name__ in ("DeepSpeedEngine", "PipelineEngine")), None)
    if engine is not None:
        if adapter is not None:
            adapter.reduced_through_data = True  # the stage-0 engine all-reduces `param.grad.data`
        if found.dp is None:
            found.dp = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
            found.source = "the DeepSpeed engine"
        mpu = getattr(engine, "mpu", None)
        if found.tp is None and mpu is not None:
            getter = getattr(mpu, "get_tensor_model_parallel_group", None) or getattr(
                mpu, "get_model_parallel_group", None
            )
            found.tp = _call(getter)
    megatron = _megatron_parallel_state()
    if megatron is not None:
        if found.dp is None:
            found.dp = _call(megatron.get_data_parallel_group, with_context_parallel=True)
            found.source = "Megatron parallel_state"
        if found.tp is None:
            found.tp = _call(megatron.get_tensor_model_parallel_group)
        found.pp = _call(megatron.get_pipeline_model_parallel_group)
    return found


def write_rule(groups: ParallelGroups, adapter: Any) -> Callable[[torch.Tensor], bool]:
    """param -> whether this rank writes its weight, reduced gradient and optimizer state.
    Evaluated here, for every parameter of the optimizer, and frozen into a lookup."""
    first_tp = _is_first(groups.tp)
    first_dp = _is_first(groups.dp)
    decided: dict[int, bool] = {}
    replicas = getattr(adapter, "replica_group", None)  # HSDP: split across one group, copied across another
    for p in adapter.params():
        split = adapter.shard_group(p)
        first = _is_first(split) if split is not None else (first_dp or _is_dtensor(p))
        if split is not None and replicas is not None:
            first = first and _is_first(replicas(p))
        decided[id(p)] = first and (first_tp or bool(getattr(p, "tensor_model_parallel", False)))
    return lambda param: decided.get(id(param), True)


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


def _is_dtensor(param: torch.Tensor) -> bool:
    """FSDP2 parameters: each rank holds a different shard, never a replica."""
    return callable(getattr(param, "to_local", None))


def _size(group: Any) -> int:
    try:
        return dist.get_world_size(group)
    except Exception:
        return 1


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    if fn is None:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception:  # not initialised, or an older signature
        try:
            return fn(*args)
        except Exception:
            return None


def _megatron_parallel_state() -> Any:
    """Megatron-core's parallel_state when the job uses it (never imported by us) and it is set up."""
    if "megatron.core" not in sys.modules:
        return None
    try:
        from megatron.core import parallel_state  # type: ignore

        return parallel_state if parallel_state.model_parallel_is_initialized() else None
    except Exception:
        return None


def attach(monitor: Any, dp_group: Any = None, tp_group: Any = None) -> Any:
    """Decide, once, what this rank writes, and return the monitor's ShardCombiner."""
    from .optimizers.shards import ShardCombiner

    adapter = monitor.adapter
    groups = discover(monitor.models, adapter, dp_group, tp_group)
    adapter.writer = write_rule(groups, adapter)
    written = sum(adapter.writer(p) for p in adapter.params())
    logger.debug(
        "msmon[rank %d]: %s optimizer, %s; this rank writes %d of %d parameters' weights, gradients and moments",
        current_rank(),
        adapter.family,
        groups.describe(),
        written,
        len(adapter.params()),
    )
    return ShardCombiner(monitor, enabled=shards_complete(adapter, monitor.config.module_ranks))

"""DeepSpeed's optimizers (layout of deepspeed 0.19): stage 0 wrappers, ZeRO-1/2 and ZeRO-3.

- `BF16_Optimizer` (stage 0 with fp32 gradient accumulation) and `DeepSpeedZeroOptimizer`
  (stages 1 and 2) keep fp32 master weights and Adam moments in one flat partition per param
  group and rank; each bit16 parameter is linked to its fragment of that partition by
  `_hp_mapping` (the linkage `safe_get_full_fp32_param` reads). A parameter can straddle two
  ranks' partitions, or lie wholly on another rank: every rank yields a Shard, empty or not.
- `DeepSpeedZeroOptimizer_Stage3` partitions every parameter: rank r holds elements
  [r*n, (r+1)*n) of it (the last rank's piece is padded, the padding is left out) in the flat
  fp32 group at `grad_position`; its inner optimizer holds the flat groups only while `step()`
  runs, so parameters come from `fp16_groups`.
- `FP16_UnfusedOptimizer` (stage 0 with bf16/fp16 gradients) keeps a whole fp32 copy of each
  parameter on every rank: nothing is sharded.

Rank-local gradients are read right before DeepSpeed reduces them (`reduce_ipg_grads` for
ZeRO-1/2, the stage-3 bucket reduce, `get_grads_for_reduction` for BF16_Optimizer): by the time
autograd's own hooks would look, DeepSpeed may already have moved them into its buckets.
The reduced gradients (`grad_reduced`) are read where DeepSpeed's `step()` hands them to the
inner torch optimizer, after it unscaled and clipped them: in a step pre-hook of that optimizer,
which ZeRO-1/2 step once per parameter group and ZeRO-3 once per sub-group (the flat fp32
partition's `.grad`; the fp32 copy's under FP16_UnfusedOptimizer).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ...seams.adapters import (
    GradPairs,
    Moments,
    OptimizerAdapter,
    Shard,
    adam_hyper,
    class_names,
    inner_moments,
    stepped_now,
)
from ...seams.patching import wrap_method

_STAGE3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
_STAGE3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class _DeepSpeedAdapter(OptimizerAdapter):
    """What every DeepSpeed wrapper shares: the inner torch optimizer, a wrapped `step`."""

    family = "deepspeed"

    @property
    def inner(self) -> Any:
        return self.optimizer.optimizer

    def data_parallel_group(self) -> Any:
        return getattr(self.optimizer, "dp_process_group", None)

    def consuming_optimizers(self) -> list[Any]:
        # ZeRO-3 with optimizer offload to an accelerator steps a backup optimizer instead
        return [o for o in (self.inner, getattr(self.optimizer, "backup_optimizer", None)) if o is not None]

    def shard_groups(self) -> list[Any]:
        groups: list[Any] = []
        for p in self.params():
            group = self.shard_group(p)
            if group is not None and all(group is not g for g in groups):
                groups.append(group)
        return groups


class HpMappingAdapter(_DeepSpeedAdapter):
    """BF16_Optimizer and DeepSpeedZeroOptimizer (ZeRO-1/2): fragments of flat fp32 partitions."""

    def __init__(self, optimizer: Any, lp_groups: list[list[torch.Tensor]], flats: list[torch.Tensor]) -> None:
        super().__init__(optimizer)
        self.lp_groups = lp_groups
        self.flats = flats
        self.group_of = {id(p): i for i, group in enumerate(lp_groups) for p in group}

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.lp_groups for p in group]

    def shard_group(self, param: torch.Tensor) -> Any:
        return getattr(param, "_dp_group", None) or self.data_parallel_group()

    def _fragment(self, param: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """param's fragment of `flat` (a flat partition or a moment shaped like it)."""
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return flat.new_empty(0)
        address = mapping.hp_fragment_address
        return flat.narrow(0, address.start, address.numel)

    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        out = {}
        for p in params:
            if id(p) in self.group_of:
                out[id(p)] = Shard(self._fragment(p, self.flats[self.group_of[id(p)]]), self.shard_group(p))
        return out

    def _grads(self, params: list[torch.Tensor], grad_of: Callable) -> dict[int, Any]:
        out = {}
        for p in params:
            if id(p) not in self.group_of:
                continue
            local = self._grad_fragment(p)
            if local is None:
                local = self.flats[self.group_of[id(p)]].new_empty(0)
            out[id(p)] = Shard(local, self.shard_group(p))
        return out

    def _consumed(self, params: list[torch.Tensor], stepping: Any) -> dict[int, Any]:
        """Fragments of the flat fp32 partitions' `.grad` stepped now (unscaled and clipped)."""
        now = stepped_now(stepping)
        out = {}
        for p in params:
            index = self.group_of.get(id(p))
            if index is None or id(self.flats[index]) not in now:
                continue
            grad = self.flats[index].grad
            local = self._fragment(p, grad) if grad is not None else self.flats[index].new_empty(0)
            out[id(p)] = Shard(local, self.shard_group(p))
        return out

    @staticmethod
    def _grad_fragment(param: torch.Tensor) -> torch.Tensor | None:
        """The reduced gradient of param's fragment, as `safe_get_full_grad` assembles it."""
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        try:
            # the ignore: DeepSpeed sets _index_in_param_group on the parameter at runtime
            grad = mapping.get_lp_grad_fragment(param._index_in_param_group)  # type: ignore[attr-defined]
        except (ValueError, KeyError, IndexError):  # no gradients between steps
            return None
        grad = grad.reshape(-1)
        address = mapping.lp_fragment_address
        if grad.numel() == param.numel() and address.numel != param.numel():
            grad = grad.narrow(0, address.start, address.numel)  # a full buffer (BF16_Optimizer)
        return grad

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        out: dict[int, Moments] = {}
        state = getattr(self.inner, "state", {})
        for p in params:
            index = self.group_of.get(id(p))
            if index is None:
                continue
            flat = self.flats[index]
            s = state.get(flat)
            hyper = adam_hyper(self.inner.param_groups[index])
            if not s or hyper is None or "exp_avg" not in s or "exp_avg_sq" not in s:
                continue
            group = self.shard_group(p)
            out[id(p)] = Moments(
                Shard(self._fragment(p, s["exp_avg"]), group),
                Shard(self._fragment(p, s["exp_avg_sq"]), group),
                s.get("step", 1),
                *hyper,
            )
        return out


class Zero12Adapter(HpMappingAdapter):
    """DeepSpeedZeroOptimizer: ZeRO stages 1 and 2."""

    hooks_unreduced = True

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer, optimizer.bit16_groups, optimizer.single_partition_of_fp32_groups)

    def hook_unreduced(self, models: list[torch.nn.Module], record: Callable[[GradPairs], None]):
        opt = self.optimizer

        def before_reduce(comm_dtype: Any = None, *_args: Any, **_kwargs: Any) -> None:
            buckets = getattr(opt, "ipg_buckets", None)
            pairs = []
            if buckets is None:  # deepspeed < 0.17: one bucket, (group, param or its index, id) entries
                for group_index, param, _param_id in getattr(opt, "params_in_ipg_bucket", []):
                    if isinstance(param, int):
                        param = opt.bit16_groups[group_index][param]
                    pairs.append((param, opt.get_gradient_for_reduction(param)))
            else:
                chosen = [buckets[comm_dtype]] if comm_dtype in buckets else list(buckets.values())
                for bucket in chosen:
                    for (group_index, index_in_group, _param_id), grad in zip(bucket.params, bucket.grads):
                        pairs.append((opt.bit16_groups[group_index][index_in_group], grad))
            if pairs:
                record(pairs)

        return wrap_method(opt, "reduce_ipg_grads", before=before_reduce)


class BF16Adapter(HpMappingAdapter):
    """BF16_Optimizer: stage 0 with bf16 weights and fp32 gradient accumulation."""

    hooks_unreduced = True

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer, optimizer.bf16_groups, optimizer.fp32_groups_flat_partition)

    def hook_unreduced(self, models: list[torch.nn.Module], record: Callable[[GradPairs], None]):
        opt = self.optimizer

        def handed_out(_result: Any, *_args: Any, **_kwargs: Any) -> None:
            # the engine asks for the fp32 accumulation buffers right before all-reducing them
            record(
                [
                    (p, g)
                    for lp_group, grads in zip(opt.bf16_groups, opt.fp32_groups_gradients)
                    for p, g in zip(lp_group, grads)
                ]
            )

        return wrap_method(opt, "get_grads_for_reduction", after=handed_out)


class FP16UnfusedAdapter(_DeepSpeedAdapter):
    """FP16_UnfusedOptimizer: a whole fp32 copy per parameter, replicated on every rank.
    Gradients are the bit16 ones the engine all-reduced (still loss-scaled under fp16)."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self.main_of = {
            id(lp): main
            for lps, mains in zip(optimizer.fp16_groups, optimizer.fp32_groups)
            for lp, main in zip(lps, mains)
        }

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.fp16_groups for p in group]

    def data_parallel_group(self) -> Any:
        return None  # the engine's; found by dedupe

    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        return {id(p): self.main_of[id(p)] for p in params if id(p) in self.main_of}

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        held = {id(self.main_of[id(p)]): id(p) for p in params if id(p) in self.main_of}
        return inner_moments(self.inner, held)

    def _consumed(self, params: list[torch.Tensor], stepping: Any) -> dict[int, Any]:
        """The fp32 copies' `.grad` (unscaled, clipped), where they are stepped now."""
        now = stepped_now(stepping)
        mains = ((p, self.main_of.get(id(p))) for p in params)
        return {id(p): m.grad for p, m in mains if m is not None and id(m) in now and m.grad is not None}


class Zero3Adapter(_DeepSpeedAdapter):
    """DeepSpeedZeroOptimizer_Stage3: every parameter partitioned across its ds_process_group."""

    hooks_unreduced = True

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self.position = {}  # id(param) -> (flat group index, offset, elements of real data here)
        for p in self.params():
            group_index, offset, partition_numel = optimizer.grad_position[optimizer.get_param_id(p)]
            rank = dist.get_rank(group=self.shard_group(p)) if dist.is_initialized() else 0
            # the ignore: ZeRO-3 sets ds_numel on each parameter at runtime
            real = max(0, min(partition_numel, p.ds_numel - rank * partition_numel))  # type: ignore[attr-defined]
            self.position[id(p)] = (group_index, offset, real)

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.fp16_groups for p in group]

    def shard_group(self, param: torch.Tensor) -> Any:
        return getattr(param, "ds_process_group", None) or self.data_parallel_group()

    def _piece(self, param: torch.Tensor, flat: torch.Tensor) -> Shard:
        _, offset, real = self.position[id(param)]
        return Shard(flat.narrow(0, offset, real), self.shard_group(param))

    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        flats = self.optimizer.fp32_partitioned_groups_flat
        return {id(p): self._piece(p, flats[self.position[id(p)][0]]) for p in params if id(p) in self.position}

    def _grads(self, params: list[torch.Tensor], grad_of: Callable) -> dict[int, Any]:
        opt = self.optimizer
        partitions = getattr(opt, _STAGE3_GRAD_PARTITIONS, {})
        out = {}
        for p in params:
            if id(p) not in self.position:
                continue
            group_index, offset, real = self.position[id(p)]
            if getattr(opt, "offload_optimizer", False):
                grad = getattr(opt.fp32_partitioned_groups_flat[group_index], "grad", None)
                grad = grad.narrow(0, offset, real) if grad is not None else None
            else:
                grad = partitions.get(p.ds_id)  # type: ignore[attr-defined]  # ZeRO-3 sets ds_id at runtime
                grad = grad.reshape(-1).narrow(0, 0, real) if grad is not None else None
            if grad is None:
                grad = opt.fp32_partitioned_groups_flat[group_index].new_empty(0)
            out[id(p)] = Shard(grad, self.shard_group(p))
        return out

    def _consumed(self, params: list[torch.Tensor], stepping: Any) -> dict[int, Any]:
        """Each partition's piece of its sub-group's flat fp32 `.grad` (unscaled, clipped),
        for the sub-group stepped now (its flat is the one tensor in the inner param groups)."""
        flats = self.optimizer.fp32_partitioned_groups_flat
        now = stepped_now(stepping)
        out = {}
        for p in params:
            if id(p) not in self.position:
                continue
            group_index, offset, real = self.position[id(p)]
            flat = flats[group_index]
            if id(flat) not in now:
                continue
            grad = flat.grad
            local = grad.narrow(0, offset, real) if grad is not None else flat.new_empty(0)
            out[id(p)] = Shard(local, self.shard_group(p))
        return out

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        opt = self.optimizer
        state = getattr(opt.optimizer, "state", {})
        out: dict[int, Moments] = {}
        for p in params:
            if id(p) not in self.position:
                continue
            sub_group = self.position[id(p)][0]
            flat = opt.fp32_partitioned_groups_flat[sub_group]
            s = state.get(flat)
            hyper = adam_hyper(opt.optimizer.param_groups[opt.sub_group_to_group_id.get(sub_group, 0)])
            if not s or hyper is None or "exp_avg" not in s or "exp_avg_sq" not in s:
                continue
            out[id(p)] = Moments(
                self._piece(p, s["exp_avg"]), self._piece(p, s["exp_avg_sq"]), s.get("step", 1), *hyper
            )
        return out

    def hook_unreduced(self, models: list[torch.nn.Module], record: Callable[[GradPairs], None]):
        opt = self.optimizer

        def before_reduce(comm_dtype: Any = None, *_args: Any, **_kwargs: Any) -> None:
            buckets = getattr(opt, "ipg_buckets", None)
            if buckets is None:  # deepspeed < 0.17: one bucket, a list of parameters
                params = list(getattr(opt, "params_in_ipg_bucket", []))
            else:
                chosen = [buckets[comm_dtype]] if comm_dtype in buckets else list(buckets.values())
                params = [p for bucket in chosen for p in bucket.params]
            pairs = [(p, p.grad) for p in params if p.grad is not None]
            if pairs:
                record(pairs)

        return wrap_method(opt, _STAGE3_REDUCE, before=before_reduce)


ADAPTERS: dict[str, Callable[[Any], OptimizerAdapter]] = {  # by class name: DeepSpeed is never imported
    "DeepSpeedZeroOptimizer_Stage3": Zero3Adapter,
    "DeepSpeedZeroOptimizer": Zero12Adapter,
    "BF16_Optimizer": BF16Adapter,
    "FP16_UnfusedOptimizer": FP16UnfusedAdapter,
}


def deepspeed_adapter(optimizer: Any) -> OptimizerAdapter | None:
    """The adapter for a DeepSpeed optimizer, by the names of its class and bases; None for others."""
    family = next((ADAPTERS[n] for n in class_names(optimizer) if n in ADAPTERS), None)
    return family(optimizer) if family is not None else None

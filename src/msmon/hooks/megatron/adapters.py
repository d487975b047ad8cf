"""Megatron-core's optimizers (layout of megatron-core 0.16): FP32Optimizer,
Float16OptimizerWithFloat16Params, DistributedOptimizer and a ChainedOptimizer of these.

- FP32Optimizer steps the model parameters themselves; gradients are `main_grad`, the
  data-parallel buffer Megatron's DDP accumulates into and reduces.
- Float16OptimizerWithFloat16Params keeps a whole fp32 copy of each bf16/fp16 parameter
  (`float16_groups` <-> `fp32_from_float16_groups`); fp32 parameters are stepped as they are.
- DistributedOptimizer gives each data-parallel rank a contiguous range of every bucket: a
  parameter's fp32 main copy, Adam moments and reduced gradient exist here only for the part
  inside this rank's range (`shard_fp32_from_float16_groups`, `shard_fp32_groups`, the range in
  `main_grad` after the reduce-scatter). Every rank yields a Shard for every parameter of the
  grad buffers, empty where it holds none.

Rank-local gradients are read when a bucket group starts its grad sync (`start_grad_sync`),
after the last micro-batch accumulated into `main_grad` and before the reduction. Reduced
gradients are read where Megatron's `step()` hands them to its inner torch optimizer, after
`prepare_grads` (copy to the main parameters' `.grad`, unscaling) and `clip_grad_norm`: in a
step pre-hook of that optimizer, from the `.grad` of the tensors it steps.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...seams.adapters import (
    GradPairs,
    Moments,
    OptimizerAdapter,
    Shard,
    TorchOptimAdapter,
    class_names,
    inner_moments,
    stepped_now,
)
from ...seams.patching import wrap_method


def hook_bucket_grad_sync(models: list[torch.nn.Module], record: Callable[[GradPairs], None]) -> Callable[[], None]:
    """Wrap `start_grad_sync` of every bucket group of Megatron's DDP model chunks."""
    undo: list[Callable[[], None]] = []
    for chunk in models:
        groups = list(getattr(chunk, "bucket_groups", None) or []) + list(
            getattr(chunk, "expert_parallel_bucket_groups", None) or []
        )
        for bucket_group in groups:

            def before_sync(*_args: Any, _group: Any = bucket_group, **_kwargs: Any) -> None:
                record([(p, p.main_grad) for p in _group.params if getattr(p, "main_grad", None) is not None])

            undo.append(wrap_method(bucket_group, "start_grad_sync", before=before_sync))

    def remove() -> None:
        for u in undo:
            u()

    return remove


class _MegatronAdapter(OptimizerAdapter):
    family = "megatron"
    hooks_unreduced = True

    @property
    def inner(self) -> Any:
        return self.optimizer.optimizer

    def hook_unreduced(self, models: list[torch.nn.Module], record: Callable[[GradPairs], None]):
        if not any(hasattr(chunk, "bucket_groups") for chunk in models):
            return None  # not wrapped in Megatron's DDP: nothing reduces main_grad in buckets
        return hook_bucket_grad_sync(models, record)

    def consuming_optimizers(self) -> list[Any]:
        inner = self.inner
        return [inner] if inner is not None else []

    def _main_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The tensor the inner optimizer steps for `param`."""
        return param

    def _consumed(self, params: list[torch.Tensor], stepping: Any) -> dict[int, Any]:
        """The `.grad` of the tensors stepped now for `params` (prepared, unscaled, clipped)."""
        if stepping is not self.inner:
            return {}
        now = stepped_now(stepping)
        mains = ((p, self._main_of(p)) for p in params)
        return {id(p): m.grad for p, m in mains if m is not None and id(m) in now and m.grad is not None}


class FP32Adapter(_MegatronAdapter):
    """FP32Optimizer: the inner torch optimizer holds the model parameters."""

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.inner.param_groups for p in group["params"]] if self.inner else []

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        return inner_moments(self.inner, {id(p): id(p) for p in params}) if self.inner else {}


class Float16Adapter(_MegatronAdapter):
    """Float16OptimizerWithFloat16Params: whole fp32 main copies of the bf16/fp16 parameters."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        opt = optimizer
        self.model_params = [p for g in getattr(opt, "float16_groups", []) for p in g] + [
            p for g in getattr(opt, "fp32_from_fp32_groups", []) for p in g
        ]
        self.main_of = {
            id(p): main
            for model, mains in zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", []))
            for p, main in zip(model, mains)
        }
        self.main_of.update({id(p): p for g in getattr(opt, "fp32_from_fp32_groups", []) for p in g})

    def params(self) -> list[torch.Tensor]:
        return list(self.model_params)

    def _main_of(self, param: torch.Tensor) -> torch.Tensor | None:
        return self.main_of.get(id(param))

    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        return {id(p): self.main_of[id(p)] for p in params if id(p) in self.main_of}

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        held = {id(self.main_of[id(p)]): id(p) for p in params if id(p) in self.main_of}
        return inner_moments(self.inner, held) if self.inner else {}


class DistributedAdapter(_MegatronAdapter):
    """DistributedOptimizer: each data-parallel rank owns a range of every parameter."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        opt = optimizer
        self.group = getattr(opt, "data_parallel_group", None)
        self.all_params = [p for buffer in getattr(opt, "buffers", []) for p in buffer.params]
        self._in_buffers = frozenset(id(p) for p in self.all_params)  # asked every step: built once
        self.main_of: dict[int, torch.Tensor] = {}
        self.span_of: dict[int, tuple[int, int]] = {}  # this rank's range of the flattened param
        for model_groups, shard_groups in (
            (getattr(opt, "model_float16_groups", []), getattr(opt, "shard_fp32_from_float16_groups", [])),
            (getattr(opt, "model_fp32_groups", []), getattr(opt, "shard_fp32_groups", [])),
        ):
            for model, shards in zip(model_groups, shard_groups):
                for p, shard in zip(model, shards):
                    if shard is not None:
                        span = opt._get_model_param_range_map(p)["param"]
                        self.main_of[id(p)] = shard
                        self.span_of[id(p)] = (span.start, span.end)

    def params(self) -> list[torch.Tensor]:
        return list(self.all_params)

    def data_parallel_group(self) -> Any:
        return self.group

    def shard_groups(self) -> list[Any]:
        return [self.group] if self.group is not None else []

    def shard_group(self, param: torch.Tensor) -> Any:
        return self.group

    def _empty(self) -> torch.Tensor:
        first = next(iter(self.main_of.values()), None)
        return first.new_empty(0) if first is not None else torch.empty(0)

    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        return {
            id(p): Shard(self.main_of.get(id(p), self._empty()), self.group)
            for p in params
            if id(p) in self._in_buffers
        }

    def _grads(self, params: list[torch.Tensor], grad_of: Callable) -> dict[int, Any]:
        out = {}
        for p in params:
            if id(p) not in self._in_buffers:
                continue
            local = self._empty()
            grad = grad_of(p)
            if id(p) in self.span_of and grad is not None:
                start, end = self.span_of[id(p)]
                local = grad.view(-1)[start:end]
            out[id(p)] = Shard(local, self.group)
        return out

    def _consumed(self, params: list[torch.Tensor], stepping: Any) -> dict[int, Any]:
        """This rank's shard main parameters' `.grad` (its range of the reduced `main_grad`,
        prepared and clipped), a Shard for every parameter of the buffers (empty where this
        rank holds none of it)."""
        if stepping is not self.inner:
            return {}
        out = {}
        for p in params:
            if id(p) not in self._in_buffers:
                continue
            main = self.main_of.get(id(p))
            grad = main.grad if main is not None else None
            out[id(p)] = Shard(grad if grad is not None else self._empty(), self.group)
        return out

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        held = {id(self.main_of[id(p)]): id(p) for p in params if id(p) in self.main_of}
        local = inner_moments(self.inner, held) if self.inner else {}
        template = next(iter(local.values()), None)
        if template is None:
            return {}
        out = {}
        for p in params:
            if id(p) not in self._in_buffers:
                continue
            m = local.get(id(p))
            if m is None:  # nothing of p on this rank: an empty piece, with the shared hyperparameters
                m = Moments(self._empty(), self._empty(), template.step, template.beta1, template.beta2, template.eps)
            out[id(p)] = Moments(
                Shard(m.exp_avg, self.group), Shard(m.exp_avg_sq, self.group), m.step, m.beta1, m.beta2, m.eps
            )
        return out


class ChainedAdapter(_MegatronAdapter):
    """ChainedOptimizer: one adapter per chained optimizer, answers merged."""

    def __init__(self, optimizer: Any, parts: list[OptimizerAdapter]) -> None:
        super().__init__(optimizer)
        self.parts = parts
        self._part_of = {id(p): part for part in parts for p in part.params()}

    def params(self) -> list[torch.Tensor]:
        return [p for part in self.parts for p in part.params()]

    def shard_groups(self) -> list[Any]:
        groups: list[Any] = []
        for part in self.parts:
            groups.extend(g for g in part.shard_groups() if all(g is not h for h in groups))
        return groups

    def shard_group(self, param: torch.Tensor) -> Any:
        part = self._part_of.get(id(param))
        return part.shard_group(param) if part is not None else None

    def data_parallel_group(self) -> Any:
        return next((g for g in (part.data_parallel_group() for part in self.parts) if g is not None), None)

    def _split(self, params: list[torch.Tensor]) -> list[tuple[OptimizerAdapter, list[torch.Tensor]]]:
        return [(part, [p for p in params if self._part_of.get(id(p)) is part]) for part in self.parts]

    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        return {k: v for part, mine in self._split(params) for k, v in part._weights(mine).items()}

    def _grads(self, params: list[torch.Tensor], grad_of: Callable) -> dict[int, Any]:
        return {k: v for part, mine in self._split(params) for k, v in part._grads(mine, grad_of).items()}

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        return {k: v for part, mine in self._split(params) for k, v in part._moments(mine).items()}

    def consuming_optimizers(self) -> list[Any]:
        return [inner for part in self.parts for inner in part.consuming_optimizers()]

    def _consumed(self, params: list[torch.Tensor], stepping: Any) -> dict[int, Any]:
        return {k: v for part, mine in self._split(params) for k, v in part._consumed(mine, stepping).items()}


MEGATRON_FAMILIES: dict[str, type[_MegatronAdapter]] = {
    "DistributedOptimizer": DistributedAdapter,
    "Float16OptimizerWithFloat16Params": Float16Adapter,
    "FP32Optimizer": FP32Adapter,
}


def megatron_adapter(optimizer: Any) -> OptimizerAdapter | None:
    """The adapter for a Megatron optimizer (by class name, so Megatron is never imported)."""
    names = class_names(optimizer)
    if "ChainedOptimizer" in names:
        parts = [megatron_adapter(inner) or TorchOptimAdapter(inner) for inner in optimizer.chained_optimizers]
        return ChainedAdapter(optimizer, parts)
    for name in names:
        if name in MEGATRON_FAMILIES:
            return MEGATRON_FAMILIES[name](optimizer)
    return None

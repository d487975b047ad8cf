"""Weights before (`param_origin`) and after (`param_updated`) the optimizer step.

A weight untouched since the last `param_updated` (same version counter) has the same
statistics, so `param_origin` reuses them: each weight is read once per step, not twice.
"""

from __future__ import annotations

import torch

from ..records.rows import row_key
from ..runtime.step_context import StepContext
from ..stats.engine import batch_stats
from ..stats.inputs import local_tensor
from .base import Collector
from .registry import register


@register(key="params", category="param", order=90, enabled=lambda cfg, ctx: cfg.param_distribution)
class ParamCollector(Collector):
    name = "weights"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self._after: dict[int, tuple[int, torch.Tensor]] = {}
        self._ops: list[str] | None = None

    def _record(self, category: str, reuse: bool) -> None:
        ctx = self.ctx
        weights = ctx.shards.take(category, ctx.adapter.weights([mp.param for mp in ctx.params]))
        tensors = {i: weights[id(mp.param)] for i, mp in enumerate(ctx.params) if id(mp.param) in weights}
        indices = [i for i, t in tensors.items() if local_tensor(t).numel() > 0]
        if not indices:
            return
        rows: dict[int, torch.Tensor] = {}
        todo = []
        for i in indices:
            cached = self._after.get(i) if reuse and self._ops == ctx.step_ops else None
            if cached is not None and cached[0] == local_tensor(tensors[i])._version:
                rows[i] = cached[1]
            else:
                todo.append(i)
        if todo:
            computed = batch_stats([tensors[i] for i in todo], ctx.step_ops, ctx.config.eps)
            for j, i in enumerate(todo):
                rows[i] = computed[j]
        keys = [row_key(category, ctx.params[i].name, ctx.params[i].vpp_stage) for i in indices]
        stacked = torch.stack([rows[i] for i in indices])
        ctx.buffer.add_many(keys, stacked)
        if category == "param_updated":
            self._ops = list(ctx.step_ops)
            self._after = {i: (local_tensor(tensors[i])._version, stacked[j]) for j, i in enumerate(indices)}

    def before_update(self) -> None:
        if self.ctx.recording:
            self._record("param_origin", reuse=True)

    def after_update(self) -> None:
        if self.ctx.recording:
            self._record("param_updated", reuse=False)
        else:
            self._after.clear()

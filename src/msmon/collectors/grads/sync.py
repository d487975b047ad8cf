"""Rank-local gradients read where the optimizer family reduces them (a bucket's grad sync).

DeepSpeed and Megatron move gradients into their own buffers during backward, so what
autograd's hooks see is not what gets reduced. Their adapters call back right before each
data-parallel reduction with (parameter, gradient) pairs; this collector records them as
`grad_unreduced`: one row per reduction with monitor_mbs_grad (ZeRO-2/3 reduce every
micro-batch, ZeRO-1 and Megatron once per step), else the last one of the step.
"""

from __future__ import annotations

import torch

from ...records.rows import row_key
from ...runtime.step_context import StepContext
from ...stats.engine import batch_stats
from ..base import Collector
from ..registry import register


@register(
    key="sync_grads",
    category="param",
    order=70,  # rank-local grads at the bucket's grad sync
    enabled=lambda cfg, ctx: cfg.wg_distribution and ctx.adapter.hooks_unreduced,
)
class SyncGradCollector(Collector):
    name = "rank-local gradients"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.index = {id(mp.param): i for i, mp in enumerate(ctx.params)}
        self.syncs: dict[int, int] = {}  # param index -> reductions seen this step
        self.last: dict[int, torch.Tensor] = {}
        self._undo = None

    def attach(self) -> None:
        self._undo = self.ctx.adapter.hook_unreduced(self.ctx.models, self.guard(self._on_sync))

    def detach(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
        super().detach()

    def _on_sync(self, pairs) -> None:
        ctx = self.ctx
        if not ctx.recording:
            return
        chosen = [(self.index[id(p)], g) for p, g in pairs if id(p) in self.index and g is not None]
        if not chosen:
            return
        rows = batch_stats([g for _, g in chosen], ctx.step_ops, ctx.config.eps)
        keys = []
        for j, (i, _) in enumerate(chosen):
            count = self.syncs.get(i, 0)
            self.syncs[i] = count + 1
            mp = ctx.params[i]
            keys.append(row_key("grad_unreduced", mp.name, mp.vpp_stage, count))
            self.last.pop(i, None)  # keep reduction order
            self.last[i] = rows[j]
        if ctx.config.monitor_mbs_grad:
            ctx.buffer.add_many(keys, rows)

    def before_update(self) -> None:
        ctx = self.ctx
        if ctx.recording and not ctx.config.monitor_mbs_grad and self.last:
            keys = [row_key("grad_unreduced", ctx.params[i].name, ctx.params[i].vpp_stage) for i in self.last]
            ctx.buffer.add_many(keys, torch.stack(list(self.last.values())))

    def end_step(self) -> None:
        self.syncs.clear()
        self.last.clear()

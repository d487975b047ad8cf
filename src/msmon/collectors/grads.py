"""Weight gradients: unreduced (rank-local, per micro-step or accumulated) and reduced.

Unreduced gradients are read in post-accumulate-grad hooks, which run right after autograd
accumulates into `.grad` and before DDP's reducer sees the gradient, so no clone is needed.
The reduced gradient is what the optimizer consumes at step time; when it is still the very
tensor the last hook saw, unmodified (same storage and version counter: no data-parallel
reduction, no clipping), its statistics are reused instead of read again.
"""
from __future__ import annotations

import torch

from ..records import RowKey
from ..stats import batch_stats, tensor_stats
from .base import Collector


def _identity(t: torch.Tensor) -> tuple[int, int, int]:
    return id(t), t.data_ptr(), t._version


class GradCollector(Collector):
    name = "weight gradients"

    def __init__(self, monitor) -> None:
        super().__init__(monitor)
        self.counts: dict[int, int] = {}
        self.last_rows: dict[int, torch.Tensor] = {}
        self.last_identity: dict[int, tuple[int, int, int]] = {}

    def attach(self) -> None:
        for index, mp in enumerate(self.mon.params):
            if mp.param.requires_grad:
                hook = self.guard(self._make_hook(index))
                self.handles.append(mp.param.register_post_accumulate_grad_hook(hook))

    def _make_hook(self, index: int):
        def on_grad_accumulated(param: torch.Tensor) -> None:
            count = self.counts.get(index, 0) + 1
            self.counts[index] = count
            mon = self.mon
            if not mon.recording or mon.adapter.hooks_unreduced:  # that family reports them at its grad sync
                return
            grad = mon.grad_of(param)
            if grad is None:
                return
            acc = mon.grad_acc_steps
            if not mon.config.monitor_mbs_grad and acc is not None and count < acc:
                return
            row = tensor_stats(grad, mon.step_ops, mon.config.eps)
            if mon.config.monitor_mbs_grad:
                mp = mon.params[index]
                mon.buffer.add(RowKey("grad_unreduced", mp.name, mp.vpp_stage, count - 1), row)
            self.last_rows.pop(index, None)  # keep hook-firing order for the accumulated rows
            self.last_rows[index] = row
            self.last_identity[index] = _identity(grad)

        return on_grad_accumulated

    def micro_steps_seen(self) -> int:
        return max(self.counts.values(), default=0)

    def before_update(self) -> None:
        mon = self.mon
        if not mon.recording:
            return
        if not mon.config.monitor_mbs_grad and self.last_rows:
            indices = list(self.last_rows)
            keys = [RowKey("grad_unreduced", mon.params[i].name, mon.params[i].vpp_stage) for i in indices]
            mon.buffer.add_many(keys, torch.stack([self.last_rows[i] for i in indices]))
        reused: dict[int, torch.Tensor] = {}
        fresh: list[int] = []
        grads: list[torch.Tensor] = []
        consumed = mon.shards.take("grad_reduced", mon.adapter.grads([mp.param for mp in mon.params], mon.grad_of))
        for index, mp in enumerate(mon.params):
            grad = consumed.get(id(mp.param))
            if grad is None:
                continue
            if index in self.last_rows and self.last_identity.get(index) == _identity(grad):
                reused[index] = self.last_rows[index]
            else:
                fresh.append(index)
                grads.append(grad)
        fresh_rows = batch_stats(grads, mon.step_ops, mon.config.eps) if grads else None
        order = sorted(list(reused) + fresh)
        if not order:
            return
        position = {index: i for i, index in enumerate(fresh)}
        rows = [reused[i] if i in reused else fresh_rows[position[i]] for i in order]
        keys = [RowKey("grad_reduced", mon.params[i].name, mon.params[i].vpp_stage) for i in order]
        mon.buffer.add_many(keys, torch.stack([r.to(rows[0].device) for r in rows]))

    def end_step(self) -> None:
        self.counts.clear()
        self.last_rows.clear()
        self.last_identity.clear()

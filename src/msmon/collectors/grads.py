"""Weight gradients: unreduced (rank-local, per micro-step or accumulated) and reduced.

Unreduced gradients are read in post-accumulate-grad hooks, which run right after autograd
accumulates into `.grad` and before DDP's reducer sees the gradient, so no clone is needed.
The reduced gradient is what the optimizer consumes at step time; when it is still the very
tensor the last hook saw, unmodified (same storage and version counter: no data-parallel
reduction, no clipping), its statistics are reused instead of read again.

Where nothing can rewrite a gradient before backward ends (no data-parallel reducer: a single
process; no other post-accumulate hook on the parameter; not per micro-step), the hooks only
note the gradient and all of them are read in one batch at the end of the backward pass
(an autograd final callback), each checked to be the very tensor the hook saw, unmodified.
One batch costs about half as much as the same reads spread over the hooks, measured
(docs/performance.md): a hook runs between backward kernels that have evicted its code and
data from the caches. If a noted gradient did change anyway, its row is left out, a warning
says so once, and the hooks read gradients themselves from then on.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..records import RowKey
from ..stats import batch_stats, tensor_stats
from .base import Collector


logger = logging.getLogger("msmon")


def _identity(t: torch.Tensor) -> tuple[int, int, int]:
    return id(t), t.data_ptr(), t._version


def _data_parallel() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class GradCollector(Collector):
    name = "weight gradients"

    def __init__(self, monitor) -> None:
        super().__init__(monitor)
        self.counts: dict[int, int] = {}
        self.last_rows: dict[int, torch.Tensor] = {}
        self.last_identity: dict[int, tuple[int, int, int]] = {}
        self.batched = True  # read at the end of backward when safe; False once that proved unsafe
        self._noted: dict[int, tuple[torch.Tensor, tuple[int, int, int], int]] = {}
        self._flush_task: int | None = None  # the backward pass whose end reads the noted gradients

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
            if self._can_wait(param):
                self._note(index, grad, count)
                return
            self._record(index, grad, count, tensor_stats(grad, mon.step_ops, mon.config.eps))

        return on_grad_accumulated

    def _record(self, index: int, grad: torch.Tensor, count: int, row: torch.Tensor) -> None:
        mon = self.mon
        if mon.config.monitor_mbs_grad:
            mp = mon.params[index]
            mon.buffer.add(RowKey("grad_unreduced", mp.name, mp.vpp_stage, count - 1), row)
        self.last_rows.pop(index, None)  # keep hook-firing order for the accumulated rows
        self.last_rows[index] = row
        self.last_identity[index] = _identity(grad)

    def _can_wait(self, param: torch.Tensor) -> bool:
        """Whether this gradient may be read at the end of backward rather than now."""
        return (self.batched and not self.mon.config.monitor_mbs_grad and not _data_parallel()
                and len(getattr(param, "_post_accumulate_grad_hooks", None) or ()) <= 1)

    def _note(self, index: int, grad: torch.Tensor, count: int) -> None:
        task = torch._C._current_graph_task_id()
        if self._flush_task != task:  # first gradient of this backward pass: read them all at its end
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.guard(self._read_noted))
        self._noted.pop(index, None)
        self._noted[index] = (grad, _identity(grad), count)

    def _read_noted(self) -> None:
        """End of backward: the noted gradients' statistics in one batch."""
        noted, self._noted, self._flush_task = self._noted, {}, None
        mon = self.mon
        unchanged = {i: entry for i, entry in noted.items() if _identity(entry[0]) == entry[1]}
        if len(unchanged) < len(noted):
            self.batched = False
            names = [mon.params[i].name for i in noted if i not in unchanged]
            logger.warning("msmon[rank %d]: gradients changed between their accumulation and the end of backward "
                           "(%s); their unreduced rows of step %d are left out, and gradients are read in the hooks "
                           "from now on", mon.rank, ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""), mon.step)
        if not unchanged or not mon.recording:
            return
        rows = batch_stats([grad for grad, _, _ in unchanged.values()], mon.step_ops, mon.config.eps)
        for j, (index, (grad, _, count)) in enumerate(unchanged.items()):
            self._record(index, grad, count, rows[j])

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
        self._noted.clear()
        self._flush_task = None

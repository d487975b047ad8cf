"""Where the first NaN/Inf came from: a finiteness flag per module input and output.

Each flag is a 0-d bool tensor computed on the device (is the sum finite? one reduction, no
sync) and appended to the step buffer in execution order; the writer thread resolves the
origin once per step, after the step's single copy to the host (see msmon.anomaly.origin). A tensor
the activation collector has read this step is not read again: its statistics row tells
(msmon.runtime.row_finiteness). Hence this collector's hooks run after the activation collector's.
Forward: flags of every module's inputs (pre-hook) and outputs (post-hook). Backward: flags of
the gradients of those same tensors, in the order autograd produces them, with the gradient
that reaches the model's output first of all (named `loss`: what the loss computed after the
model sent back). After backward: flags of the weights' gradients, which code outside every
module may still change (a tensor hook on a weight, a write into `.grad`).
"""

from __future__ import annotations

import logging
import math

import torch

from ...records.rows import LOSS, RowKey, row_key
from ...runtime.row_finiteness import row_finiteness
from ...runtime.selection import recorded_modules
from ...runtime.step_context import StepContext
from ...runtime.tensor_memo import TensorMemo
from ...seams import guest_hooks
from ...stats.inputs import local_tensor
from ..base import Collector
from ..module_io import CallCounter, call_name, in_backward, tensors_in
from ..registry import register
from .first_step import OriginWork

logger = logging.getLogger("msmon")


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d witness of `t`'s finiteness, one reduction: its sum is finite exactly when `t` has
    no NaN/Inf (accumulated in float32 or wider, so overflow needs values near 1e38). The test
    itself, isfinite, runs once per step on all the witnesses stacked (StepBuffer.take), not
    in the hook: one kernel per tensor instead of five."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.detach().sum(dtype=acc)


@register(
    key="nan_origin", category="module", order=55, module_hooks=True, enabled=lambda cfg, ctx: cfg.nan_origin_enabled
)
class NanOriginCollector(Collector):
    name = "nan origin"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        named_modules = ctx.names()[0]
        self.modules = [
            (m, n, c, c) for c, named in enumerate(named_modules) for n, m in recorded_modules(named).items()
        ]
        # the last chunk's root: the loss is computed from its output (after the model, or inside
        # its forward but outside every submodule, where the submodules' gradients tell)
        self.root = (
            (named_modules[-1][""], len(named_modules) - 1) if named_modules and "" in named_modules[-1] else None
        )
        self._calls = CallCounter()
        self._open: dict[int, list[tuple[int, str]]] = {}
        self._grad_callback = self._on_grad  # one bound method, not a new one per tensor and step
        self._witnesses: TensorMemo[torch.Tensor] = TensorMemo()  # this step's tensors reduced already
        self.work = OriginWork()  # this step's, said once at start when the alert rules switched it on
        self.last_work = OriginWork()  # the last step's (benchmarks/nan_origin_cost.py reads it)
        self._said = ctx.config.nan_origin is not None  # asked for by name: nothing to say

    def attach(self) -> None:
        for module, name, vpp, chunk in self.modules:
            self.handles.append(
                guest_hooks.forward_pre_hook(module, self.guard(self._pre(name, vpp, chunk)), with_kwargs=True)
            )
            self.handles.append(guest_hooks.forward_hook(module, self.guard(self._post(name, vpp)), with_kwargs=True))
        if self.root is not None:
            root, chunk = self.root
            self.handles.append(guest_hooks.forward_hook(root, self.guard(self._root_post(chunk)), with_kwargs=True))

    def before_update(self) -> None:
        """The weights' gradients as the optimizer will see them, after every hook ran."""
        ctx = self.ctx
        if not ctx.recording:
            return
        by_device: dict[tuple[torch.device, torch.dtype], list[tuple[RowKey, torch.Tensor]]] = {}
        for mp in ctx.params:
            grad = ctx.grad_of(mp.param)
            if isinstance(grad, torch.Tensor) and grad.is_floating_point() and not grad.is_sparse:
                grad = local_tensor(grad).detach()  # this rank's shard: no collective
                if grad.numel():
                    key = row_key("grad_reduced", mp.name, mp.vpp_stage)
                    by_device.setdefault((grad.device, grad.dtype), []).append((key, grad))
        for items in by_device.values():
            # the largest magnitude of each: NaN or Inf exactly when the gradient holds one (a
            # sum could overflow), in a few fused kernels for all the weights; the witnesses
            # are tested with the step's other flags
            witnesses = torch._foreach_norm([g for _, g in items], math.inf)
            for (key, _), witness in zip(items, witnesses):
                ctx.buffer.add_flag(key, witness)

    def end_step(self) -> None:
        self._calls.clear()
        self._open.clear()
        self._witnesses.clear()
        if not self._said and self.ctx.recording:
            self._said = True
            if self.ctx.rank == 0:
                logger.info(self.work.line(self.ctx.rank, self.ctx.step))
        self.last_work, self.work = self.work, OriginWork()

    def _flag(self, category: str, name: str, vpp: int, micro: int, tensors) -> None:
        for t in tensors:
            if t.is_floating_point() and t.numel():
                self._add(row_key(category, name, vpp, micro), t)

    def _add(self, key: RowKey, t: torch.Tensor) -> None:
        ctx = self.ctx
        test = row_finiteness(ctx.step_ops)
        row = ctx.rows_read.get(t) if test is not None else None
        if row is not None:
            ctx.buffer.add_flag_of_row(key, row, test)  # type: ignore[arg-type]
            self.work.from_rows += 1
            return
        witness = self._witnesses.get(t)  # one module's output is the next one's input: reduced once
        if witness is None:
            witness = finite_flag(t)
            self._witnesses.put(t, witness)
            self.work.reductions += 1
        ctx.buffer.add_flag(key, witness)

    def _grad_hooks(self, name: str, vpp: int, micro: int, tensors) -> None:
        if not torch.is_grad_enabled():
            return
        key = row_key("actv_grad", name, vpp, micro)
        for t in tensors:
            if t.requires_grad and t.is_floating_point():
                self.ctx.grad_hooks.add(t, self, self._grad_callback, key)

    def _on_grad(self, key: RowKey, grad: torch.Tensor) -> None:
        if grad is not None and grad.numel() and self.ctx.recording:
            self.work.gradients += 1
            self._add(key, grad)

    def _pre(self, name: str, vpp: int, chunk: int):
        ctx = self.ctx

        def pre_hook(module, args, kwargs):
            if not ctx.recording or not module.training or in_backward() or ctx.in_gradless_forward(chunk):
                return None
            self.work.module_hooks += 2  # this one and its post-hook
            micro = ctx.forward_micro_step(chunk)
            base = call_name(name, self._calls.next(module, micro))
            self._open.setdefault(id(module), []).append((micro, base))
            inputs = tensors_in(args) + tensors_in(kwargs)
            self._flag("actv", f"{base}.input", vpp, micro, inputs)
            self._grad_hooks(f"{base}.input", vpp, micro, inputs)
            return None

        return pre_hook

    def _root_post(self, chunk: int):
        ctx = self.ctx

        def post_hook(module, args, kwargs, output):
            if not ctx.recording or not module.training or in_backward() or ctx.in_gradless_forward(chunk):
                return None
            self._grad_hooks(LOSS, chunk, ctx.forward_micro_step(chunk), tensors_in(output))
            return None

        return post_hook

    def _post(self, name: str, vpp: int):
        def post_hook(module, args, kwargs, output):
            in_flight = self._open.get(id(module))
            if not in_flight:
                return None
            micro, base = in_flight.pop()
            outputs = tensors_in(output)
            self._flag("actv", f"{base}.output", vpp, micro, outputs)
            self._grad_hooks(f"{base}.output", vpp, micro, outputs)
            return None

        return post_hook

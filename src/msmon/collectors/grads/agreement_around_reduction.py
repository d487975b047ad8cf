"""grad_agreement where a framework reduces whole gradients itself, not a torch DDP module.

DeepSpeed's stage 0, Megatron's DDP without the distributed optimizer and FSDP1 NO_SHARD each
average the gradients in place at a point of their own; each framework declares where
(Framework.whole_gradient_reduction). Right before it the rank-local gradients are copied
(into grad_agreement.LocalCopies' flat buffers), right after it the copies are compared with the
whole average now in `.grad`. The weight-gradient collector (msmon.collectors.grads.collector) owns this
object and writes its result with the step's other rows.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ...runtime.step_context import StepContext
from ...stats.sparse import is_sparse
from . import agreement as grad_agreement

logger = logging.getLogger("msmon")

Pairs = list[tuple[torch.Tensor, torch.Tensor | None]]


class AroundFrameworkReduction:
    """The copies taken before a framework's reduction and the agreement taken after it."""

    def __init__(
        self,
        ctx: StepContext,
        guard: Callable[[Callable[..., Any]], Callable[..., Any]],
        copies: grad_agreement.LocalCopies,
        known_norms: Callable[[dict[int, torch.Tensor]], dict[int, torch.Tensor]],
    ) -> None:
        self.ctx = ctx
        self.guard = guard
        self.copies = copies
        self.known_norms = known_norms  # grad_unreduced's norms of gradients as they are now
        self.index_of = {id(mp.param): i for i, mp in enumerate(ctx.params)}
        self.agreed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.lost = False  # a parameter reduced twice in this step: its local gradient is gone
        self._undo: Callable[[], None] | None = None
        self._before: dict[int, torch.Tensor] = {}
        self._norms: dict[int, torch.Tensor] = {}
        self._copied: set[int] = set()
        self._lost_said = False

    def hook(self) -> bool:
        """Follow the first framework whose reduction leaves whole gradients; whether one is."""
        ctx = self.ctx
        for framework in ctx.frameworks:
            if framework.whole_gradient_reduction is None:
                continue
            try:
                undo = framework.whole_gradient_reduction(
                    ctx.models, ctx.adapter.optimizer, self.guard(self.copy_before), self.guard(self.agree_after)
                )
            except Exception as exc:  # a layout msmon does not know: no agreement there, training goes on
                logger.warning(
                    "msmon[rank %d]: cannot follow %s's gradient reduction (%r) (said once)",
                    ctx.rank,
                    framework.name,
                    exc,
                )
                continue
            if undo is not None:
                self._undo = undo
                return True
        return False

    def undo(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()
        self._before.clear()

    def copy_before(self, pairs: Pairs | None) -> None:
        """Right before the framework reduces these (parameter, rank-local gradient) pairs in
        place (None: every monitored parameter's gradient): the local gradients, copied. A
        parameter reduced a second time in one step (accumulation without `no_sync()`) has lost
        its local gradient: the step then gets no agreement."""
        ctx = self.ctx
        if not ctx.recording or self._undo is None:
            return
        if pairs is None:
            pairs = [(mp.param, ctx.grad_of(mp.param)) for mp in ctx.params if mp.param.requires_grad]
        grads: dict[int, torch.Tensor] = {}
        for param, grad in pairs:
            index = self.index_of.get(id(param))
            if index is None or grad is None or is_sparse(grad):
                continue
            if index in self._copied:
                self.lost = True
            self._copied.add(index)
            grads[index] = grad
            self._before[index] = self.copies.copy(index, grad)
        self._norms.update(self.known_norms(grads))

    def agree_after(self) -> None:
        """Right after it: the copies against the whole average now in `.grad`."""
        ctx, local = self.ctx, self._before
        if not local:
            return
        if self.lost:  # an earlier reduction's agreement is not the step's either
            self._before, self._norms, self.agreed = {}, {}, None
            if not self._lost_said:
                self._lost_said = True
                logger.warning(
                    "msmon[rank %d]: step %d reduced a gradient more than once (accumulation without "
                    "no_sync()?): its rank-local gradient is no longer known, so no grad_agreement row "
                    "is written for such a step (said once)",
                    ctx.rank,
                    ctx.step,
                )
            return
        pairs = {index: (kept, ctx.grad_of(ctx.params[index].param)) for index, kept in local.items()}
        self.agreed = grad_agreement.of_pairs(pairs, self._norms, self.copies) or self.agreed
        self._before, self._norms = {}, {}

    def end_step(self) -> None:
        self.agreed = None
        self.lost = False
        self._before.clear()
        self._norms.clear()
        self._copied.clear()

"""Weight gradients: unreduced (rank-local, per micro-step or accumulated) and reduced.

Unreduced gradients are read in post-accumulate-grad hooks, which run right after autograd
accumulates into `.grad` and before DDP's reducer sees the gradient, so no clone is needed.
That holds while no earlier micro-batch of the step was all-reduced (single process, or DDP
with `no_sync()` for all but the last micro-batch). When DDP reduces a micro-batch that is
not the step's last (accumulation without `no_sync()`), `.grad` is the reduced sum from then
on: the rank-local sum is then kept apart, a copy of `.grad` taken right before the reduction
plus each later micro-batch's incoming gradient (a tensor hook, registered with the copy, sees
it before it is accumulated), one gradient's memory for that parameter until the step's rows
are taken. When grad_acc_steps is not known yet (step 0 while it is inferred), every reduced
micro-batch might be followed by another, so the copy is taken at each of them in that step.
A `.grad` rewritten between micro-batches by anything else (its version counter moved by more
than the one in-place add of an accumulation) is left out with a warning, never misreported.
Views of one tensor share its version counter (DDP's `gradient_as_bucket_view` makes every
`.grad` of a bucket a view of it), so the counter is followed per tensor it belongs to, and
checked only at its first accumulation in a backward pass: since its last one in the previous
pass, exactly that one add may have moved it.

The reduced gradient is what the optimizer consumes at step time; when it is still the very
tensor the last hook saw, unmodified (same storage and version counter: no data-parallel
reduction, no clipping), its statistics are reused instead of read again. Optimizers that clip
or unscale inside their own `step()` and then step an inner torch optimizer (DeepSpeed's,
Megatron's: `adapter.consuming_optimizers()`) have it read in a step pre-hook of that inner
optimizer instead, as it consumes them: once per inner step (DeepSpeed steps it per parameter
group), never outside an optimizer step (a checkpoint load's dummy step), and not at all on a
step the framework skips (fp16 overflow: nothing is consumed).

With `step(closure)` (LBFGS evaluates its closure up to max_eval times per step) the step's
gradients are those of its first closure evaluation, at the weights the step starts from;
later evaluations inside the step are neither counted as micro-batches nor recorded.

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
from typing import Any, Callable

import torch

from ...records.rows import row_key
from ...runtime.step_context import StepContext
from ...seams import grad_rewrites
from ...stats.engine import tensor_stats
from ...stats.sparse import any_layout_stats, sparse_stats
from ...system.distributed import several_processes
from ..base import Collector
from ..registry import COUNTS_BACKWARD, register
from . import agreement as grad_agreement
from . import unused_params
from .agreement_around_reduction import AroundFrameworkReduction
from .ddp_sync import DdpSync
from .local_sums import LocalSums
from .reduced_rows import identity, record_reduced, record_unreduced
from .tensors import counter_of, hooks_that_may_write

logger = logging.getLogger("msmon")


@register(key="grads", category="param", order=80, enabled=lambda c, _: c.wg_distribution, serves=COUNTS_BACKWARD)
class GradCollector(Collector):
    name = "weight gradients"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.counts: dict[int, int] = {}
        self.last_rows: dict[int, torch.Tensor] = {}
        self.last_identity: dict[int, tuple[int, int, int]] = {}
        self.batched = True  # read at the end of backward when safe; False once that proved unsafe
        self._noted: dict[int, tuple[torch.Tensor, tuple[int, int, int], int]] = {}
        self._flush_task: int | None = None  # the backward pass whose end reads the noted gradients
        self._sync: DdpSync | None = None  # under data parallelism: which backward passes DDP reduces
        self._sums = LocalSums(self.guard)  # rank-local sums kept apart from a reduced `.grad`
        self._reduced: set[int] = set()  # params whose `.grad` DDP reduced in an earlier micro-batch
        # version counter owner (`_counter_of`) -> (backward pass, version) as its last accumulation left it
        self._versions: dict[int, tuple[int, int]] = {}
        self._lost_said = False
        self._consumed = False  # the step's gradients were taken (later closure evaluations are not counted)
        self.at_inner_step = False  # grad_reduced is read where an inner torch optimizer consumes it
        # grad_agreement: whether it is recorded here, the backward pass whose end computes it, its values
        self.agreeing = False
        self._agree_task: int | None = None
        self._agreed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._agreed_is_lost = False  # a rank-local gradient of the step is gone (unused_params.py)
        self._copies: grad_agreement.LocalCopies | None = None  # the agreement's copies, kept across steps
        self._row_pass: dict[int, int] = {}  # the backward pass whose hook last recorded each row
        # a framework that reduces whole gradients itself (Framework.whole_gradient_reduction)
        self._framework: AroundFrameworkReduction | None = None
        self._rewrites: grad_rewrites.Listening | None = None  # a GradScaler's unscale_, watched

    def attach(self) -> None:
        ctx = self.ctx
        if several_processes() and not ctx.adapter.hooks_unreduced:
            self._sync = DdpSync(ctx.models, {id(mp.param) for mp in ctx.params})
        for index, mp in enumerate(ctx.params):
            if mp.param.requires_grad:
                hook = self.guard(self._make_hook(index))
                self.handles.append(mp.param.register_post_accumulate_grad_hook(hook))
        inners = ctx.adapter.consuming_optimizers()
        self.at_inner_step = bool(inners) and all(isinstance(o, torch.optim.Optimizer) for o in inners)
        if ctx.config.grad_agreement:
            why = grad_agreement.unavailable(
                several_processes(), ctx.adapter.hooks_unreduced, type(ctx.adapter).__name__
            )
            if several_processes():
                self._copies = grad_agreement.LocalCopies(
                    {i: mp.param for i, mp in enumerate(ctx.params) if mp.param.requires_grad}
                )
                around = AroundFrameworkReduction(ctx, self.guard, self._copies, self._fresh_norms)
                if around.hook():  # the framework's own reduction leaves whole gradients
                    self._framework = around
                    why = None
            self.agreeing = why is None
            if not self.agreeing:
                self._copies = None
            if why is not None and "grad_agreement" not in ctx.kept:
                ctx.kept["grad_agreement"] = why  # said once per monitor, not at every rebuild
                grad_agreement.say_unavailable(ctx.rank, why)
        if self.at_inner_step:
            on_inner_step = self.guard(self._on_inner_step)
            self.handles.extend(inner.register_step_pre_hook(on_inner_step) for inner in inners)
        self._rewrites = grad_rewrites.listen(self.guard(self._on_rewrite))

    def _on_rewrite(self, optimizer: Any) -> None:
        """A GradScaler unscaled `optimizer`'s gradients in place, leaving their version counters
        as they were: no row of this step describes them any more (grad_reduced reads them again)."""
        if self.last_identity and {id(mp.param) for mp in self.ctx.params} & grad_rewrites.params_of(optimizer):
            self.last_identity.clear()

    def detach(self) -> None:
        if self._rewrites is not None:
            self._rewrites.stop()
            self._rewrites = None
        self._sums.drop()
        if self._framework is not None:
            framework, self._framework = self._framework, None
            framework.undo()
        if self._copies is not None:
            self._copies.clear()
        super().detach()

    def _norms_read(self, grads: dict, fresh: Callable[[int, torch.Tensor], bool]) -> dict[int, torch.Tensor]:
        """The L2 norms grad_unreduced's rows already hold for these gradients (by index), where
        `fresh` says a row describes the gradient as it is now."""
        ops = list(self.ctx.step_ops)
        if "norm" not in ops:
            return {}
        column = ops.index("norm")
        return {i: self.last_rows[i][column] for i, grad in grads.items() if i in self.last_rows and fresh(i, grad)}

    def _fresh_norms(self, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The norms grad_unreduced's rows hold for these gradients as they are now."""
        return self._norms_read(grads, lambda i, grad: self.last_identity.get(i) == identity(grad))

    @property
    def local(self) -> dict[int, torch.Tensor]:
        """The rank-local sums kept apart from a reduced `.grad`, by parameter index (local_sums.py)."""
        return self._sums.local

    def _keep_local(self, index: int, param: torch.Tensor, grad: torch.Tensor, more: bool, zero: bool = False) -> None:
        self._sums.keep(index, param, grad, self._copies if self.agreeing else None, more, zero)

    def _make_hook(self, index: int):
        def on_grad_accumulated(param: torch.Tensor) -> None:
            if self._consumed:  # a later closure evaluation inside step(closure)
                return
            count = self.counts.get(index, 0) + 1
            self.counts[index] = count
            ctx = self.ctx
            if not ctx.recording or ctx.adapter.hooks_unreduced:  # that family reports them at its grad sync
                return
            grad = ctx.grad_of(param)
            if grad is None:
                return
            acc = ctx.grad_acc_steps
            sync = self._sync
            if sync is not None:
                grad = self._rank_local(sync, index, param, grad, acc is not None and count >= acc)
                if grad is None:
                    return
            if not ctx.config.monitor_mbs_grad and acc is not None and count < acc:
                return
            if self._can_wait(param):
                self._note(index, grad, count)
                return
            stats = tensor_stats if grad.layout is torch.strided else sparse_stats  # is_sparse, inline
            self._record(index, grad, count, stats(grad, ctx.step_ops, ctx.config.eps))

        return on_grad_accumulated

    def _rank_local(
        self, sync: DdpSync, index: int, param: torch.Tensor, grad: torch.Tensor, last: bool
    ) -> torch.Tensor | None:
        """The rank-local gradient accumulated so far, where `.grad` may hold a reduced sum;
        None when that is no longer known (it was reduced and no copy was kept)."""
        reduced_before = index in self._reduced
        if not reduced_before and self._rewritten(grad):
            self._reduced.add(index)
            self._left_out(
                index,
                f"the gradient of {self.ctx.params[index].name} was rewritten in place between "
                "micro-batches by something other than DDP's reduction of a forward (a manual "
                "all-reduce?)",
            )
            return None
        if sync.reduces(param):
            self._reduced.add(index)
            if self.agreeing:
                self._agree_at_end()
            # about to be reduced, and more micro-batches follow (or the agreement needs it)
            if not reduced_before and (not last or self.agreeing):
                self._keep_local(index, param, grad, more=not last)
        local = self.local.get(index)
        if local is not None:
            return local
        if reduced_before:
            self._left_out(
                index,
                f"step {self.ctx.step} ran more micro-batches than grad_acc_steps="
                f"{self.ctx.grad_acc_steps}, all-reduced by DDP (no no_sync()); set grad_acc_steps "
                "to the real count",
            )
            return None
        self._versions[counter_of(grad)] = (torch._C._current_graph_task_id(), grad._version)
        return grad

    def _rewritten(self, grad: torch.Tensor) -> bool:
        """Whether `.grad` changed since the last micro-batch otherwise than by this accumulation
        (one in-place add: its version counter goes up by exactly one). A host-side check, made
        at the first accumulation into the counter's tensor in this backward pass; later ones in
        the same pass follow each other with nothing of the script's in between."""
        seen = self._versions.get(counter_of(grad))
        return seen is not None and seen[0] != torch._C._current_graph_task_id() and grad._version != seen[1] + 1

    def _agree_at_end(self) -> None:
        """Have the agreement computed once this backward pass's reduction is done: a callback
        queued from within the end-of-backward callbacks runs after all of them, DDP's included."""
        task = torch._C._current_graph_task_id()
        if self._agree_task == task:
            return
        self._agree_task = task
        queue = torch.autograd.Variable._execution_engine.queue_callback
        queue(self.guard(lambda: queue(self.guard(self._agree))))

    def _agree(self) -> None:
        """End of a backward pass DDP reduced: the local sums kept against the reduced `.grad`.
        When the step's micro-batch count is known, only its last pass computes them, and the
        copies are spent in the dot product (they go back now anyway); the local norms the
        hooks of that pass already computed (grad_unreduced's rows) are not read again."""
        ctx = self.ctx
        task, self._agree_task = self._agree_task, None
        acc = ctx.grad_acc_steps
        last = acc is not None and self.micro_steps_seen() >= acc
        unused = unused_params.unused_here(ctx, self.local, self.counts, self._sync)
        self._agreed_is_lost = self._agreed_is_lost or unused is None
        for index in unused or ():  # a zero local sum, that later micro-batches add to
            self._reduced.add(index)
            param = ctx.params[index].param
            self._keep_local(index, param, ctx.grad_of(param), more=not last, zero=True)  # type: ignore[arg-type]
        if acc is not None and not last:  # a later pass of this step is reduced too and decides
            return
        if self._agreed_is_lost:
            self._agreed = None
        else:
            pairs = {index: (kept, ctx.grad_of(ctx.params[index].param)) for index, kept in self.local.items()}
            norms = self._norms_read(self.local, lambda i, _grad: self._row_pass.get(i) == task)  # this pass's
            self._agreed = grad_agreement.of_pairs(pairs, norms, self._copies if last else None) or self._agreed
        if last:  # the step's last: the copies go back now
            self._sums.drop()

    def _left_out(self, index: int, why: str) -> None:
        self.last_rows.pop(index, None)
        if not self._lost_said:
            self._lost_said = True
            logger.warning(
                "msmon[rank %d]: %s: the rank-local gradient of the step is no longer known, so its "
                "grad_unreduced rows are left out (said once)",
                self.ctx.rank,
                why,
            )

    def _record(self, index: int, grad: torch.Tensor, count: int, row: torch.Tensor) -> None:
        ctx = self.ctx
        if ctx.config.monitor_mbs_grad:
            mp = ctx.params[index]
            ctx.buffer.add(row_key("grad_unreduced", mp.name, mp.vpp_stage, count - 1), row)
        self.last_rows.pop(index, None)  # keep hook-firing order for the accumulated rows
        self.last_rows[index] = row
        self.last_identity[index] = identity(grad)
        if self.agreeing:
            self._row_pass[index] = torch._C._current_graph_task_id()

    def _can_wait(self, param: torch.Tensor) -> bool:
        """Whether this gradient may be read at the end of backward rather than now."""
        return (
            self.batched
            and not self.ctx.config.monitor_mbs_grad
            and not several_processes()
            and hooks_that_may_write(param) <= 1
        )

    def _note(self, index: int, grad: torch.Tensor, count: int) -> None:
        task = torch._C._current_graph_task_id()
        if self._flush_task != task:  # first gradient of this backward pass: read them all at its end
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.guard(self._read_noted))
        self._noted.pop(index, None)
        self._noted[index] = (grad, identity(grad), count)

    def _read_noted(self) -> None:
        """End of backward: the noted gradients' statistics in one batch."""
        noted, self._noted, self._flush_task = self._noted, {}, None
        ctx = self.ctx
        unchanged = {i: entry for i, entry in noted.items() if identity(entry[0]) == entry[1]}
        if len(unchanged) < len(noted):
            self.batched = False
            names = [ctx.params[i].name for i in noted if i not in unchanged]
            logger.warning(
                "msmon[rank %d]: gradients changed between their accumulation and the end of backward "
                "(%s); their unreduced rows of step %d are left out, and gradients are read in the hooks "
                "from now on",
                ctx.rank,
                ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""),
                ctx.step,
            )
        if not unchanged or not ctx.recording:
            return
        rows = any_layout_stats([grad for grad, _, _ in unchanged.values()], ctx.step_ops, ctx.config.eps)
        for j, (index, (grad, _, count)) in enumerate(unchanged.items()):
            self._record(index, grad, count, rows[j])

    def micro_steps_seen(self) -> int:
        return max(self.counts.values(), default=0)

    def before_update(self) -> None:
        self._consumed = True
        if self._sums.local:  # their rows are taken: the copies' memory goes back now, not at the step's end
            self._sums.drop()
        ctx = self.ctx
        if not ctx.recording:
            return
        framework = self._framework
        agreed = self._agreed if framework is None else framework.agreed or self._agreed
        if agreed is not None:
            grad_agreement.add_rows(ctx.buffer, ctx.step_ops, *agreed)
        elif (
            self.agreeing
            and not (framework is not None and framework.lost or self._agreed_is_lost)
            and ("grad_agreement" not in ctx.kept)
        ):
            ctx.kept["grad_agreement"] = why = (
                "nothing msmon follows reduced the monitored gradients in this step (no torch DDP "
                "module, DeepSpeed stage-0 engine, Megatron DDP or FSDP NO_SHARD unit: a manual all-reduce?)"
            )
            grad_agreement.say_unavailable(ctx.rank, why)
        if not ctx.config.monitor_mbs_grad and self.last_rows:
            record_unreduced(ctx, self.last_rows)
        if not self.at_inner_step:
            self._record_reduced(ctx.adapter.grads([mp.param for mp in ctx.params], ctx.grad_of))

    def _on_inner_step(self, inner: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
        """The inner optimizer is about to consume the gradients of the groups it steps now."""
        ctx = self.ctx
        if self._consumed and ctx.recording:  # inside an optimizer step this monitor saw begin
            self._record_reduced(ctx.adapter.consumed_grads([mp.param for mp in ctx.params], inner))

    def _record_reduced(self, values: dict) -> None:
        record_reduced(self.ctx, values, self.last_rows, self.last_identity)

    def end_step(self) -> None:
        self._consumed = False
        self._sums.drop()
        self._reduced.clear()
        self._versions.clear()
        self.counts.clear()
        self.last_rows.clear()
        self.last_identity.clear()
        self._noted.clear()
        self._flush_task = None
        self._agree_task = None
        self._agreed = None
        self._agreed_is_lost = False
        self._row_pass.clear()
        if self._framework is not None:
            self._framework.end_step()

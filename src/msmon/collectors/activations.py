"""Module inputs/outputs in forward (`actv`) and their gradients in backward (`actv_grad`).

Forward statistics are taken in hooks as the module runs: inputs in the pre-hook (before an
in-place module such as ReLU(inplace=True) overwrites them), outputs in the post-hook.
Gradients come from tensor hooks registered on those same tensors during forward (never
module full-backward hooks, which break in-place ops that follow the module): output_grad is
the gradient of the module's output; input_grad is the gradient of its input tensor, which
equals the module's own contribution unless that tensor also feeds other modules.

Nothing is cloned and nothing is synchronised; each hook appends one row to the step buffer. On
the CPU's own path the hook launches the statistic kernels itself. On the accelerator path
(msmon.runtime.hook_batch) it only notes the tensor, and every tensor noted is read in one batch
at the end of the model's forward (a forward hook on each model chunk, registered after the
targets' hooks), at the end of the backward pass, before an in-place module (`inplace=True`)
overwrites its input, before a collective writes into a noted tensor (more than one process:
msmon.runtime.collective_flush), and before the step's rows are taken; the rows keep their place in the
buffer. A tensor changed in place before its batch point anyway (an in-place op outside every
module) has its row left out rather than misreported, a warning says so once, and that row is
read in the hook from then on. Forward passes inside a backward (activation checkpoint
recomputation) are detected by the autograd engine's graph-task id, not by walking the stack:
they are not recorded again, but their tensors get the gradient hooks when the first pass ran
without grad (reentrant checkpointing), so gradients are still recorded once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..config import TensorSpec
from ..records.rows import RowKey, row_key
from ..runtime.buffer import RowGroup
from ..runtime.collective_flush import FlushBeforeCollectives
from ..runtime.hook_batch import PendingRow, batches
from ..runtime.selection import xy_targets
from ..runtime.step_context import StepContext
from ..seams import guest_hooks
from ..stats import fused_rows
from ..stats.engine import tensor_stats
from ..system.distributed import several_processes
from .base import Collector
from .micro_steps import TRACKER, MicroStepTracker
from .module_io import CallCounter, call_name, in_backward, select
from .registry import register

logger = logging.getLogger("msmon")

__all__ = ["TRACKER", "ActivationCollector", "MicroStepTracker"]

_MAX_CACHED_KEYS = 1 << 16  # row keys kept between steps (names of calls in a loop can grow it)


def _graphs_compiled() -> bool:
    """Whether torch.compile built a graph of the user's in this process (dynamo's own count, less
    the graphs of msmon's compiled statistics; dynamo is not imported here when nothing imported it)."""
    return fused_rows.users_graphs_compiled()


def _batchable(t: torch.Tensor) -> bool:
    """A plain dense tensor on the accelerator path (a DTensor or a sparse tensor has no one data
    pointer to check at the batch point: it is read in the hook)."""
    return type(t) is torch.Tensor and t.layout is torch.strided and batches(t.device)


def _device_of(models: list[torch.nn.Module]) -> torch.device:
    for model in models:
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


class _Target:
    __slots__ = ("module", "name", "vpp_stage", "chunk", "specs")

    def __init__(
        self, module: torch.nn.Module, name: str, vpp_stage: int, chunk: int, specs: dict[str, TensorSpec]
    ) -> None:
        self.module = module
        self.name = name
        self.vpp_stage = vpp_stage
        self.chunk = chunk
        self.specs = specs


@register(key="activations", category="module", order=50, module_hooks=True, enabled=lambda cfg, ctx: cfg.xy_enabled)
class ActivationCollector(Collector):
    name = "activations"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.targets = [_Target(*t) for t in xy_targets(ctx.config, ctx.names()[0])]
        if ctx.config.xy_name_contains and ctx.rank == 0:  # msprobe V2's substring targets, expanded
            logger.info(
                "msmon: xy_name_contains %s selects the modules %s",
                ctx.config.xy_name_contains,
                ", ".join(dict.fromkeys(t.name for t in self.targets)),
            )
        self._calls = CallCounter()
        self._recompute_calls = CallCounter()
        self._warned: set[str] = set()
        self._each_call = ctx.config.xy_each_call
        self._groups: dict[RowKey, RowGroup] = {}  # this step's rows, one group per key
        self._repeats: dict[str, int] = {}  # module -> most calls in one micro-step (this step)
        self._told_repeats = False
        self._hooks_ran = 0  # forward pre-hooks that ran eagerly this step (none: compiled)
        self._told_compiled = False
        self._open: dict[int, list[tuple[int, str, bool]]] = {}  # id(module) -> calls in flight
        self._keys: dict[tuple[str, str, str, int, int, int], list[RowKey]] = {}
        self._grad_callback = self._on_grad  # one bound method, not a new one per tensor and step
        self._lost_callback = self._on_lost
        self._collectives: FlushBeforeCollectives | None = None  # reads the notes before a collective
        self._in_hook: set[tuple[str, str]] = set()  # (category, name) read in the hook: once lost in a batch
        self._batching = False  # whether the model's tensors are noted and read in batches (set at attach)

    def attach(self) -> None:
        for target in self.targets:
            module = target.module
            self.handles.append(
                guest_hooks.forward_pre_hook(module, self.guard(self._make_pre_hook(target)), with_kwargs=True)
            )
            self.handles.append(
                guest_hooks.forward_hook(module, self.guard(self._make_post_hook(target)), with_kwargs=True)
            )
        # after the targets' own hooks (a chunk may be a target): the end of a forward is a batch point
        self._batching = bool(self.targets) and batches(_device_of(self.ctx.models))
        if not self._batching:
            return  # the CPU's own path reads in the hooks: no batch point to add, nothing to note
        end_of_forward = self.guard(self._end_of_forward)
        self.handles.extend(guest_hooks.forward_hook(chunk, end_of_forward) for chunk in self.ctx.models)
        if several_processes():
            self._collectives = FlushBeforeCollectives(self.ctx.hook_batch)
            self._collectives.start()

    def detach(self) -> None:
        if self._collectives is not None:
            self._collectives.stop()
            self._collectives = None
        super().detach()

    def _end_of_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        batch = self.ctx.hook_batch
        if len(batch) and not in_backward():
            batch.flush()

    def _stats(self, key: RowKey, t: torch.Tensor) -> torch.Tensor | PendingRow:
        """One read per tensor and version: one module's output is usually the next one's input
        (and they share a gradient); the non-finite origin's flags use these rows too. On the
        accelerator path the read waits for the next batch point (a PendingRow)."""
        ctx = self.ctx
        rows_read = ctx.rows_read
        row = rows_read.get(t)
        if row is None:  # unread: noted for the batch where it may be, else read now
            if self._batching and _batchable(t) and (key.category, key.name) not in self._in_hook:
                row = ctx.hook_batch.note(t, self, self._lost_callback, key)
            else:
                row = tensor_stats(t, ctx.step_ops, ctx.config.eps)
        elif (
            self._in_hook
            and isinstance(row, PendingRow)
            and row.row is None
            and (key.category, key.name) in self._in_hook
        ):
            row = tensor_stats(t, ctx.step_ops, ctx.config.eps)  # noted, but this key is read in the hook now
        else:
            return row  # read already (the common case: decided before the in-hook set is asked)
        rows_read.put(t, row)
        return row

    def _add(self, key: RowKey, t: torch.Tensor) -> None:
        """Append the statistics of `t` under `key`; repeated calls of a module join one group."""
        row = self._stats(key, t)
        if self._each_call:
            self.ctx.buffer.add(key, row)
            return
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = RowGroup(self.ctx.step_ops)
            self.ctx.buffer.add(key, group)
        group.add(row, t.numel())

    def _on_lost(self, key: RowKey) -> None:
        """A noted tensor changed before its batch point: its row is left out; read it in the hook
        from now on."""
        if not self._in_hook:
            logger.warning(
                "msmon[rank %d]: %s %s was changed in place after its hook and before msmon read it "
                "(step %d): its row is left out, and it is read in the hook from now on (said once)",
                self.ctx.rank,
                key.category,
                key.name,
                self.ctx.step,
            )
        self._in_hook.add((key.category, key.name))

    def end_step(self) -> None:
        if self.ctx.recording:
            self._tell_once()
        self._calls.clear()
        self._recompute_calls.clear()
        self._open.clear()
        self._groups.clear()
        self._repeats.clear()
        self._hooks_ran = 0

    def _tell_once(self) -> None:
        """One line the first time modules ran repeatedly, and the first time none ran eagerly."""
        ctx = self.ctx
        if self._repeats and not self._told_repeats:
            self._told_repeats = True
            top = sorted(self._repeats.items(), key=lambda item: -item[1])
            listed = ", ".join(f"{name} x{calls}" for name, calls in top[:3]) + (" ..." if len(top) > 3 else "")
            how = (
                "one row per call ('xy_each_call': true)"
                if self._each_call
                else "their statistics are combined into one row per micro-step (norm over all calls, min/max of "
                "all, mean weighted by size); 'xy_each_call': true gives one row per call"
            )
            logger.warning(
                "msmon[rank %d]: %d module(s) ran more than once in a micro-step (%s): %s",
                ctx.rank,
                len(top),
                listed,
                how,
            )
        if (
            self.targets
            and not self._hooks_ran
            and not self._told_compiled
            and any(mp.param.grad is not None for mp in ctx.params)
        ):
            self._told_compiled = True
            if self.stepped_aside is not None and self.stepped_aside != "torch.compile":
                logger.warning(
                    "msmon[rank %d]: step %d ran the monitored modules' forward only inside %s, where msmon "
                    "steps aside so as not to change what the transform builds; their activations are not "
                    "recorded (everything else is)",
                    ctx.rank,
                    ctx.step,
                    self.stepped_aside,
                )
            elif _graphs_compiled():
                logger.warning(
                    "msmon[rank %d]: step %d trained without running any monitored module's forward "
                    "eagerly: modules run by torch.compile execute compiled graphs, from which msmon's hooks "
                    "are left out so as not to break them; their activations are not recorded",
                    ctx.rank,
                    ctx.step,
                )
            else:
                logger.warning(
                    "msmon[rank %d]: step %d trained without calling any monitored module (%d of them, "
                    "e.g. %s); no activation was recorded",
                    ctx.rank,
                    ctx.step,
                    len(self.targets),
                    repr(self.targets[0].name) if self.targets[0].name else "the model itself",
                )

    # -- naming -------------------------------------------------------------------------------
    def _call_index(self, target: _Target, micro: int, recompute: bool) -> int:
        return (self._recompute_calls if recompute else self._calls).next(target.module, micro)

    @staticmethod
    def _names(base: str, slot: str, count: int) -> list[str]:
        if count == 1:
            return [f"{base}.{slot}"]
        return [f"{base}.{slot}_{i}" for i in range(count)]

    def _row_keys(self, category: str, target: _Target, base: str, slot: str, count: int, micro: int) -> list[RowKey]:
        """The keys of a slot's `count` tensors, looked up once per slot and step: the interned
        keys (records.row_key, the same objects the non-finite origin names the tensors with)
        and the names built for them, kept between steps."""
        ident = (category, base, slot, count, micro, target.vpp_stage)
        keys = self._keys.get(ident)
        if keys is None:
            if len(self._keys) >= _MAX_CACHED_KEYS:
                self._keys.clear()
            keys = self._keys[ident] = [
                row_key(category, name, target.vpp_stage, micro) for name in self._names(base, slot, count)
            ]
        return keys

    def _warn_once(self, target: _Target, slot: str, message: str) -> None:
        key = f"{target.name}.{slot}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "msmon[rank %d]: target %s %s: %s; nothing recorded for it", self.ctx.rank, target.name, slot, message
            )

    def _tensors(self, target: _Target, slot: str, value: Any) -> list[torch.Tensor]:
        tensors, problem = select(value, target.specs.get(slot))
        if problem:
            self._warn_once(target, slot, problem)
        return tensors

    # -- hooks --------------------------------------------------------------------------------
    def _make_pre_hook(self, target: _Target):
        ctx = self.ctx

        def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._hooks_ran += 1
            if not ctx.recording or not module.training or ctx.in_gradless_forward(target.chunk):
                return None
            recompute = in_backward()
            micro = ctx.backward_micro_step if recompute else ctx.forward_micro_step(target.chunk)
            call = self._call_index(target, micro, recompute)
            if call and not recompute:
                self._repeats[target.name] = max(self._repeats.get(target.name, 0), call + 1)
            value = (args + tuple(kwargs.values())) if kwargs else args
            base = call_name(target.name, call) if self._each_call else target.name
            # remember the call so the post-hook and the gradient hooks use the same name
            self._open.setdefault(id(module), []).append((micro, base, recompute))
            if not recompute and not ctx.config.backward_only:
                self._record_forward(target, "input", value, micro, base)
            self._grad_hooks(target, "input", value, micro, base)
            # the batch first: `inplace` is missing on most modules, and torch's Module.__getattr__
            # raises (and getattr catches) an AttributeError per hook call to say so
            if ctx.hook_batch.noted and getattr(module, "inplace", False) is True:
                ctx.hook_batch.flush()  # read the noted tensors before the module overwrites its input
            return None

        return pre_hook

    def _make_post_hook(self, target: _Target):
        ctx = self.ctx

        def post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            in_flight = self._open.get(id(module))
            if not in_flight:
                return None
            micro, base, recompute = in_flight.pop()
            if not ctx.recording:
                return None
            if not recompute and not ctx.config.backward_only:
                self._record_forward(target, "output", output, micro, base)
            self._grad_hooks(target, "output", output, micro, base)
            return None

        return post_hook

    def _record_forward(self, target: _Target, slot: str, value: Any, micro: int, base: str) -> None:
        tensors = self._tensors(target, slot, value)
        for key, t in zip(self._row_keys("actv", target, base, slot, len(tensors), micro), tensors):
            if t.numel():
                self._add(key, t)

    def _grad_hooks(self, target: _Target, slot: str, value: Any, micro: int, base: str) -> None:
        """Register gradient hooks on the tensors the `{slot}_grad` spec selects."""
        ctx = self.ctx
        if ctx.config.forward_only or not torch.is_grad_enabled():
            return
        tensors = self._tensors(target, f"{slot}_grad", value)
        for key, t in zip(self._row_keys("actv_grad", target, base, slot, len(tensors), micro), tensors):
            if not t.requires_grad or not t.is_floating_point():
                continue
            ctx.grad_hooks.add(t, self, self._grad_callback, key)

    def _on_grad(self, key: RowKey, grad: torch.Tensor) -> None:
        if grad is not None and self.ctx.recording and grad.numel():
            self._add(key, grad)

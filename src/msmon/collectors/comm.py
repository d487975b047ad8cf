"""Collective communication (cc_distribution): what goes through torch.distributed collectives.

For every collective call the statistics of its result buffers ("post") are taken when the
result is there (at return, or at `Work.wait()` for async ops), and of its source buffers
("pre") at launch when cc_pre_hook is on. Calls are grouped per (op, call site, pre/post)
within a step, on the device, and combined exactly at the step's end (`stats.combine_rows`:
norm from the sum of squares, min of mins, max of maxes, count-weighted mean, summed counts),
so a step adds one row per group, named `{op}@{file}[{line}]/{pre|post}` in category "other"
(CSV `other_*.csv`; TensorBoard `{op}@{file}[{line}]/rank{r}/{pre|post}_{stat}`).

Each row's stage is the pass its first call ran in: backward inside autograd and after it
until the model's next forward (gradient all-reduces), optimizer inside the step, else forward.
cc_codeline keeps only calls from the listed code lines; cc_log_only logs each distinct
collective once during the first step, then stops the job cleanly (exit code 0).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..records.rows import BACKWARD, FORWARD, OPTIMIZER, RowKey, format_tag
from ..runtime.step_context import StepContext
from ..seams import collective_listeners as cc
from ..seams import guest_hooks
from ..seams.collective_calls import CallSite, CollectiveCall
from ..stats.combine import combine_rows
from ..stats.engine import batch_stats
from ..stats.inputs import local_tensor
from .base import Collector
from .module_io import in_backward, tensors_in
from .registry import register

logger = logging.getLogger("msmon")


class StopAfterCommLog(SystemExit):
    """Raised after cc_log_only logged the first step's collectives: a clean stop (exit 0)."""


class CodelineFilter:
    """cc_codeline: which call sites are recorded. An entry matches a site `/path/file.py[23]`
    when it names its tail (`file.py[23]`, `pkg/file.py[23]`) or, as a regular expression,
    is found in it. No entry: every site. Decisions are cached per site."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = list(patterns)
        self._compiled = [re.compile(p) for p in patterns]
        self._cache: dict[str, bool] = {}

    def __call__(self, site: CallSite) -> bool:
        if not self.patterns:
            return True
        where = site.full
        hit = self._cache.get(where)
        if hit is None:
            hit = self._cache[where] = any(
                where == p or where.endswith("/" + p) or where.endswith(os.sep + p) or rx.search(where)
                for p, rx in zip(self.patterns, self._compiled)
            )
        return hit


@dataclass(frozen=True)
class CollectiveKey(RowKey):
    """A collective's row: name `{op}@{site}/{pre|post}`, tagged msprobe's way for collectives,
    `{op}@{site}/rank{r}/{pre|post}` (sinks append `_{stat}`), not `{vpp}:{name}/rank{r}/other`."""

    def tag(self, rank: int | None) -> str:
        op, _, phase = self.name.rpartition("/")
        return format_tag(op, rank, phase)


@dataclass
class _Series:
    """The calls of one (op, call site, pre/post) within a step: one stats row per tensor."""

    key: RowKey
    rows: list[torch.Tensor] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


@register(key="comm", category="comm", order=110, enabled=lambda cfg, ctx: cfg.cc_distribution.enable)
class CommCollector(Collector):
    """Listens to the torch.distributed instrumentor; see the module docstring."""

    name = "collective communication"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        config = ctx.config.cc_distribution
        self.selects = CodelineFilter(config.cc_codeline)
        self.pre_hook = config.cc_pre_hook
        self.log_only = config.cc_log_only
        self._series: dict[tuple[str, str, str], _Series] = {}
        self._logged: set[tuple] = set()
        self._group_ranks: dict[int, list[int]] = {}
        self._in_update = False
        self._pass = FORWARD
        self._instrumented = False
        # the listener interface, guarded: a failure switches this collector off
        self.on_launch = self.guard(self._on_launch)
        self.on_complete = self.guard(self._on_complete)

    # -- attach / detach ----------------------------------------------------------------------
    def attach(self) -> None:
        rank = self.ctx.rank
        if not dist.is_available():
            logger.warning(
                "msmon[rank %d]: cc_distribution is on but this torch has no torch.distributed; "
                "no collective is recorded",
                rank,
            )
            return
        if not dist.is_initialized():
            logger.warning(
                "msmon[rank %d]: cc_distribution is on but torch.distributed is not initialised; "
                "collectives are recorded once init_process_group has run",
                rank,
            )
        self._instrumented = cc.acquire()
        cc.add_listener(self)
        if not self.log_only:
            for chunk in self.ctx.models:
                self.handles.append(guest_hooks.forward_pre_hook(chunk, self.guard(self._forward_starts)))
                self.handles.append(guest_hooks.forward_hook(chunk, self.guard(self._forward_ends)))

    def detach(self) -> None:
        super().detach()
        cc.remove_listener(self)
        if self._instrumented:
            self._instrumented = False
            cc.release()

    # -- which pass a call runs in -------------------------------------------------------------
    def _forward_starts(self, module, args) -> None:
        if not in_backward():  # not a checkpoint recomputation
            self._pass = FORWARD

    def _forward_ends(self, module, args, output) -> None:
        if in_backward() or not torch.is_grad_enabled():
            return
        for t in tensors_in(output):
            if t.requires_grad:  # fires when this output's gradient arrives: backward has begun
                t.register_hook(self.guard(self._backward_begins))
                break

    def _backward_begins(self, grad) -> None:
        self._pass = BACKWARD

    def _stage(self) -> str:
        """Inside autograd or the optimizer step, that; else the pass the model is in, so a
        gradient all-reduce after loss.backward() counts as backward."""
        if in_backward():
            return BACKWARD
        return OPTIMIZER if self._in_update else self._pass

    # -- listener -----------------------------------------------------------------------------
    def wants(self) -> bool:
        return self.enabled and (self.log_only or self.ctx.recording)

    def _on_launch(self, call: CollectiveCall) -> bool:
        if self.log_only:
            self._log_call(call)
            return False
        if not self.selects(call.site):
            return False
        stage = self._stage()
        call.extra[id(self)] = stage
        if self.pre_hook:
            self._record(call, "pre", call.inputs, stage)
        return True

    def _on_complete(self, call: CollectiveCall) -> None:
        if self.ctx.recording:
            self._record(call, "post", call.outputs, call.extra.get(id(self), FORWARD))

    def _record(self, call: CollectiveCall, phase: str, tensors: list[torch.Tensor], stage: str) -> None:
        tensors = [t for t in (local_tensor(x) for x in tensors) if t.numel()]
        if not tensors:
            return
        ctx = self.ctx
        rows = batch_stats(tensors, ctx.step_ops, ctx.config.eps)
        group = (call.op, call.site.short, phase)
        series = self._series.get(group)
        if series is None:
            name = f"{call.op}@{call.site.short}/{phase}"
            series = self._series[group] = _Series(CollectiveKey("other", name, stage=stage))
        series.rows.append(rows)
        series.counts.extend(t.numel() for t in tensors)

    # -- the step -----------------------------------------------------------------------------
    def before_update(self) -> None:
        self._in_update = True

    def after_update(self) -> None:
        self._in_update = False
        cc.deliver_completed()
        series, self._series = self._series, {}
        if not series or not self.ctx.recording:
            return
        ops = self.ctx.step_ops
        keys, rows = [], []
        for s in series.values():
            device = s.rows[0].device
            pieces = torch.cat([r.to(device) for r in s.rows]) if len(s.rows) > 1 else s.rows[0]
            if pieces.shape[0] == 1:
                rows.append(pieces[0])
            else:
                counts = torch.tensor(s.counts, dtype=torch.float64).to(device, non_blocking=True)
                rows.append(combine_rows(pieces, counts, ops))
            keys.append(s.key)
        device = rows[0].device
        self.ctx.buffer.add_many(keys, torch.stack([r.to(device, non_blocking=True) for r in rows]))

    def step_skipped(self) -> None:
        """No step ended (a GradScaler skipped it): its collectives are forgotten, and cc_log_only
        stops after a real step."""
        self._series.clear()
        self._in_update = False
        self._pass = FORWARD

    def end_step(self) -> None:
        self.step_skipped()
        if self.log_only and self.enabled:
            ctx = self.ctx
            logger.info(
                "msmon[rank %d]: cc_log_only: %d distinct collectives logged in step %d; stopping as "
                "cc_log_only asks (put the sites to record in cc_codeline, then turn cc_log_only off)",
                ctx.rank,
                len(self._logged),
                ctx.step,
            )
            ctx.stop()
            raise StopAfterCommLog(0)

    # -- cc_log_only --------------------------------------------------------------------------
    def _ranks_of(self, group) -> list[int]:
        if not dist.is_initialized():
            return []
        ranks = self._group_ranks.get(id(group))
        if ranks is None:
            ranks = self._group_ranks[id(group)] = dist.get_process_group_ranks(group or dist.group.WORLD)
        return ranks

    def _log_call(self, call: CollectiveCall) -> None:
        tensors = call.inputs or call.outputs
        dtype = str(tensors[0].dtype).replace("torch.", "") if tensors else "-"
        shape = str(tuple(tensors[0].shape)) if tensors else "-"
        if len(tensors) > 1:
            shape = f"{len(tensors)} x {shape}"
        ranks = self._ranks_of(call.group)
        signature = (call.op, call.site.full, dtype, shape, tuple(ranks))
        if signature in self._logged:
            return
        self._logged.add(signature)
        logger.info(
            "msmon[rank %d] collective: %s at %s in %s() dtype=%s shape=%s group ranks=%s (%s)",
            self.ctx.rank,
            call.op,
            call.site.short,
            call.site.function,
            dtype,
            shape,
            ranks,
            call.site.path,
        )

"""Which micro-step a forward or a backward belongs to, for every collector that names rows by it."""

from __future__ import annotations

import torch

from ..config import MonitorConfig
from ..runtime.step_context import StepContext
from ..seams import guest_hooks
from ..seams.adapters import in_closure_reevaluation
from .base import Collector
from .l2_features.targets import l2_enabled
from .module_io import in_backward, select
from .registry import TRACKS_MICRO_STEPS, register

TRACKER = "micro_steps"  # the registry key of MicroStepTracker


def _tracker_enabled(cfg: MonitorConfig, ctx: StepContext) -> bool:
    return cfg.xy_enabled or cfg.print_struct or cfg.nan_origin_enabled or l2_enabled(cfg, ctx)


@register(
    key=TRACKER, category="module", order=10, module_hooks=True, enabled=_tracker_enabled, serves=TRACKS_MICRO_STEPS
)
class MicroStepTracker(Collector):
    """Counts forward passes of each model chunk within a step (the micro-step of a
    forward), and which micro-batch's backward is running (for recomputed modules).

    A forward of the whole chunk with gradients off (`torch.no_grad()` in training mode: a
    metric, a look-ahead) trains nothing: it is not counted, so it shifts no micro-step, and
    the activation hooks skip what runs inside it. So does a forward inside a step closure's
    later evaluations (LBFGS runs the closure up to max_eval times in one step)."""

    name = "micro-step tracking"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        chunks = self.chunks = list(ctx.models)
        self.forward_counts = [0] * len(chunks)
        self.backward_micro = 0
        self._gradless = [0] * len(chunks)  # chunk forwards in flight with gradients off
        self._open: list[list[bool]] = [[] for _ in chunks]  # per chunk: was each call in flight counted?

    def attach(self) -> None:
        for index, chunk in enumerate(self.chunks):
            self.handles.append(guest_hooks.forward_pre_hook(chunk, self.guard(self._make_pre(index))))
            self.handles.append(guest_hooks.forward_hook(chunk, self.guard(self._make_post(index))))

    def _make_pre(self, index: int):
        def pre_hook(module, args) -> None:
            if not module.training or in_backward():
                self._open[index].append(False)
            elif torch.is_grad_enabled() and not in_closure_reevaluation():
                self.forward_counts[index] += 1
                self._open[index].append(False)
            else:
                self._gradless[index] += 1
                self._open[index].append(True)
            return None

        return pre_hook

    def _make_post(self, index: int):
        def post_hook(module, args, output) -> None:
            if self._open[index] and self._open[index].pop():
                self._gradless[index] -= 1
                return None
            if not module.training or in_backward() or not torch.is_grad_enabled():
                return None
            micro = self.forward_counts[index] - 1
            for t in select(output, None)[0]:
                if t.requires_grad:
                    t.register_hook(self.guard(self._make_grad_hook(micro)))
                    break
            return None

        return post_hook

    def _make_grad_hook(self, micro: int):
        def hook(grad) -> None:
            self.backward_micro = micro
            return None

        return hook

    def forward_micro(self, chunk: int) -> int:
        return max(self.forward_counts[chunk] - 1, 0)

    def in_gradless_forward(self, chunk: int) -> bool:
        return self._gradless[chunk] > 0

    def end_step(self) -> None:
        self.forward_counts = [0] * len(self.chunks)
        self.backward_micro = 0
        self._gradless = [0] * len(self.chunks)
        self._open = [[] for _ in self.chunks]

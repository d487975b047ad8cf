"""The loss of each micro-step (`loss_distribution`), with no change to the script.

Every backward pass starts from a scalar: the loss. While this collector is attached, the
backward calls are watched (seams/backward_calls.py) and each one that starts from a
single floating-point element is one micro-step's loss, numbered in call order within the
step: a row of category `loss` (column `value`, `loss_*.csv`, the TensorBoard scalar
`0:loss:{micro}/rank{r}/loss_value`, the rows AnomalyRankOutlier reads its loss from) and an
entry of `ctx.losses` (the step's losses on the device). The value is the script's own loss,
copied on the device as backward starts (a one-element clone: no host read), so the training is
unchanged, the row holds the loss bit for bit, and a write into the loss tensor after backward
(an in-place all-reduce for logging) is not recorded.

Where a loss scaler scaled the tensor backward runs on, the unscaled loss the scaler was given
is recorded instead (torch's GradScaler, Megatron's grad_scale_func, DeepSpeed's
engine.backward: each framework declares its scaler). A backward call on a tensor of several
elements, or on several tensors at once, has no loss to record: no row, and one log line says so.
A script that calls backward twice per forward (two losses) gets two rows, as the gradient
hooks count two micro-batches. A backward pass that reaches none of the monitored parameters
(another model's: a GAN's discriminator, a frozen reference) is not this monitor's: a
post-accumulate hook per parameter, a flag set and nothing else, tells them apart.
"""

from __future__ import annotations

import logging
import sys

import torch

from ..records.rows import RowKey
from ..runtime.step_context import StepContext
from ..seams import backward_calls
from .base import READS_NOTHING, Collector
from .registry import register

logger = logging.getLogger("msmon")

LOSS_CATEGORY, LOSS_NAME, LOSS_COLUMN = "loss", "loss", "value"


def loss_scaling_in_use(ctx: StepContext) -> list[backward_calls.LossScaling]:
    """The loss scalers of the frameworks whose library this process has imported."""
    declared = []
    for framework in ctx.frameworks:
        if framework.loss_scaling is not None and framework.switched_on_by in sys.modules:
            declared.append(framework.loss_scaling())
    return declared


@register(key="loss", category="check", order=65, enabled=lambda cfg, ctx: cfg.loss_distribution)
class LossCollector(Collector):
    name = "loss"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.micro_steps = 0  # backward passes seen this step
        self._listening: backward_calls.Listening | None = None
        self._said: set[str] = set()
        self._reached = False  # a monitored parameter's gradient was accumulated since the last backward call

    def attach(self) -> None:
        def reached(_param: torch.Tensor) -> None:
            self._reached = True  # the whole hook: it runs once per parameter and backward pass

        setattr(reached, READS_NOTHING, True)
        for mp in self.ctx.params:
            if mp.param.requires_grad:
                self.handles.append(mp.param.register_post_accumulate_grad_hook(reached))
        self._listening = backward_calls.listen(
            self.guard(self._on_loss), self.guard(self._on_skipped), loss_scaling_in_use(self.ctx), self._on_start
        )

    def detach(self) -> None:
        if self._listening is not None:
            self._listening.stop()
            self._listening = None
        super().detach()

    def _on_start(self) -> None:
        """A backward call starts: whether it reaches this model is told by its own hooks (a
        call with no loss, on a tensor of several elements, must not leave its flag set)."""
        self._reached = False

    def _on_loss(self, loss: torch.Tensor, _scale: torch.Tensor | None) -> None:
        reached, self._reached = self._reached, False
        if not reached and self.handles:  # another model's backward pass (its own monitor records it)
            return
        ctx = self.ctx
        micro = self.micro_steps
        self.micro_steps += 1
        ctx.losses.append(loss)
        if ctx.recording:
            row = loss.to(torch.float64).reshape(1).expand(len(ctx.step_ops))
            ctx.buffer.add(RowKey(LOSS_CATEGORY, LOSS_NAME, 0, micro, op=LOSS_COLUMN), row)

    def _on_skipped(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            logger.warning("msmon[rank %d]: no loss row for %s (said once)", self.ctx.rank, why)

    def end_step(self) -> None:
        self.micro_steps = 0

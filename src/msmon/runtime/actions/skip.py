"""`{"do": "skip_step", "on": [...], "max_per_run": N}`: the step's update is not applied, on any rank.

GradScaler's semantics: when the step's statistics call for it, the optimizer step of that step
is not applied on any rank and its gradients are dropped (set to None, as `zero_grad()` does),
so every rank's weights and optimizer state after the step equal those before it, bit for bit,
and training goes on with the next batch.

When it is decided. Before the optimizer step, so the decision needs the step's statistics on
the host before `optimizer.step` runs, as GradScaler needs its found-inf flag: in the step's
pre-hook, once the monitor has read the gradients, the rows recorded so far (activations, the
rank-local and, under torch.optim, the reduced gradients) are read on the host (a device sync on
an accelerator) and the alert rules look at them as the writer's do: the statistics rows (the
loss and the other values of columns of their own are no rule's; a loss spike shows in the
gradients it makes), with a history of their own fed only these rows, which a skipped step's
values leave again (as Lightning's SpikeDetection keeps a spike out of its running mean). Every
rank gives what it saw to one gather on msmon's group (vote.py) and decides alike. Only with a
skip_step action configured; the cost (the sync, the rule scan, one gather per step) is in
docs/actions.md and benchmarks/nan_stop_cost.py. A step that is not recorded is never skipped
(no statistics); rules known only after the step (AnomalyRankOutlier, NanOrigin,
ReplicaMismatch) are refused by the config check.

How. Only where msmon owns the step call: a step pre-hook on the optimizer that applies the
update (torch.optim and FSDP's, or DeepSpeed's inner torch optimizer, stepped by its engine)
drops the parameters' gradients when the step is skipped, so the optimizer skips every
parameter, as torch's optimizers do for a parameter without a gradient. Megatron's optimizer and
other wrappers step through paths msmon does not drive: at attach, one line says so and skip_step
stands down (the rest of the monitoring goes on). A
step run with a closure (LBFGS, Lightning's automatic optimization) computes its gradients
inside `step`, after the hook: skip_step stands down with one line.

Each skip is counted in summary.json (`skipped_steps`), and written in Megatron's tracker
format and Lightning's skip_batches.json in the output root (output/skipped_steps.py). An
action stands down after `max_per_run` skips (one line): a fault that keeps coming back is
not one to keep skipping.
"""

from __future__ import annotations

import logging
import pickle
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...anomaly.rules import RuleEngine, build_rules
from ...anomaly.seen import from_alert
from ...config.schema import ActionConfig
from ...output.sinks.feature_rows import split_features
from ...output.skipped_steps import record_skip
from .decide import Trigger, triggers, views
from .vote import FINITE, StepVote

if TYPE_CHECKING:
    from ..step_context import StepContext

logger = logging.getLogger("msmon")

STEP_OWNERS = ("torch", "fsdp1", "fsdp2", "deepspeed")  # adapter families whose update msmon can hold back


def step_owners(adapter: Any) -> tuple[list[Any], str | None]:
    """The torch optimizers whose step applies `adapter`'s update, or why msmon does not own it."""
    family = getattr(adapter, "family", "")
    if family not in STEP_OWNERS:
        return [], (
            f"skip_step needs msmon to own the optimizer step (torch.optim, FSDP, DeepSpeed's engine); this job's "
            f"optimizer is {family or type(adapter.optimizer).__name__}'s, whose step runs its own path (Megatron: "
            "found_inf) that msmon does not drive"
        )
    owners = adapter.consuming_optimizers() if family == "deepspeed" else [adapter.optimizer]
    if not owners or not all(isinstance(o, torch.optim.Optimizer) for o in owners):
        return [], (
            f"skip_step: the optimizer {type(adapter.optimizer).__name__} does not step through a torch.optim "
            "optimizer that msmon can hold back"
        )
    return owners, None


class SkipStep:
    """The skip_step actions of one monitor (module docstring)."""

    def __init__(self, ctx: StepContext, actions: list[ActionConfig], vote: StepVote) -> None:
        self.ctx = ctx
        self.actions = actions  # every action of alert.actions (a trigger's index is its place there)
        self.vote = vote
        self.engine = RuleEngine(build_rules(ctx.config.alert.rules))  # fed the pre-step rows only
        self.skipping = False  # this step's update is held back
        self.skipped: list[dict[str, Any]] = []
        self.off: str | None = None
        self._counts: dict[int, int] = {}
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None  # the rules' history before this step
        self._removers: list[Callable[[], None]] = []

    @property
    def speaker(self) -> bool:
        return self.ctx.rank == self.vote.members()[0]

    def install(self, adapter: Any) -> None:
        """The pre-hooks that drop the gradients of a skipped step (after the monitor's own); where
        msmon does not own the step, skip_step stands down with one line, at attach."""
        owners, why_not = step_owners(adapter)
        if why_not is not None:
            self._stand_down(why_not)
        for optimizer in owners:
            handle = optimizer.register_step_pre_hook(self._drop_grads)
            self._removers.append(handle.remove)

    def remove(self) -> None:
        for remove in self._removers:
            remove()
        self._removers.clear()

    def _drop_grads(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if callable(kwargs.get("closure")) or any(callable(a) and a is not optimizer for a in args):
            self._stand_down(
                "this optimizer's step runs a closure (LBFGS, Lightning's automatic optimization): "
                "its gradients exist only inside the step, after msmon could hold it back"
            )
            return
        if self.skipping:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def decide(self) -> None:
        """Before the optimizer step (the step's pre-hook, after the monitor read the gradients):
        whether every rank skips this step. Every monitored rank calls it at every step."""
        ctx = self.ctx
        self.skipping = False
        self._before = None
        mine = b""
        if ctx.recording and self.off is None:
            mine = self._what_i_saw()
        answered = self.vote.round(FINITE, mine)
        if not answered.payloads:
            return
        seen = [one for payload in answered.payloads if payload for one in pickle.loads(payload)]
        skips = [a if a.do == "skip_step" else None for a in self.actions]
        for view in views(seen, self.vote.members()):
            for trigger in triggers(self.actions, view):
                if skips[trigger.index] is not None and self._allowed(trigger):
                    self._skip(trigger)
                    return

    def _what_i_saw(self) -> bytes:
        ctx = self.ctx
        ctx.hook_batch.flush()
        keys, chunks = ctx.buffer.rows_so_far()
        if not keys:
            return b""
        table = torch.cat([c.detach().to("cpu", torch.float64) for c in chunks])  # the host sync skip_step costs
        ops = ctx.ops_written  # the columns the writer's rules read (not a derived op's bases)
        keys, table, _ = split_features(ctx.step, ctx.rank, keys, table[:, : len(ops)], {})
        self._before = self.engine.snapshot()
        alerts = self.engine.scan(keys, ops, None, table)
        seen = [from_alert(ctx.rank, ctx.step, alert) for alert in alerts]
        return pickle.dumps(seen) if seen else b""

    def _allowed(self, trigger: Trigger) -> bool:
        done = self._counts.get(trigger.index, 0)
        if done >= trigger.action.max_per_run:
            return False
        self._counts[trigger.index] = done + 1
        if done + 1 == trigger.action.max_per_run and self.speaker:
            logger.warning(
                "msmon: alert.actions[%d] (skip_step) skipped %d steps, its max_per_run; it skips no more steps",
                trigger.index,
                done + 1,
            )
        return True

    def _skip(self, trigger: Trigger) -> None:
        ctx = self.ctx
        self.skipping = True
        if self._before is not None:  # a skipped step's values do not enter the history (Lightning's SpikeDetection)
            self.engine.restore(self._before)
        self.skipped.append({"step": ctx.step, "action": trigger.index, "why": trigger.why()})
        if not self.speaker:
            return
        logger.warning(
            "msmon: step %d is not applied on any rank (alert.actions[%d] skip_step: %s); its gradients are dropped",
            ctx.step,
            trigger.index,
            trigger.why(),
        )
        try:
            record_skip(
                ctx.output_base, ctx.step, trigger.ranks[0] if trigger.ranks else ctx.rank, ctx.grad_acc_steps or 1
            )
        except OSError as exc:
            logger.error("msmon: writing the skipped step %d to the output root failed: %s", ctx.step, exc)

    def _stand_down(self, why: str) -> None:
        if self.off is None:
            self.off = why
            logger.error("msmon[rank %d]: skip_step is off: %s", self.ctx.rank, why)

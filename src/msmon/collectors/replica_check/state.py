"""What the replica check keeps across the monitor's collector rebuilds (ReplicaState), and
one check on its way to the exchange thread (Job)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...runtime.exchange_thread import ExchangeThread
from .entries import CheckedTensor, Entry, SkippedTensor

if TYPE_CHECKING:
    from ...config import ReplicaCheckConfig
    from ...runtime.step_context import StepContext

logger = logging.getLogger("msmon")

KEY = "replica_check"


@dataclass
class Job:
    step: int
    entries: list[Entry]
    header: torch.Tensor  # int64 [step, layout digest] on the host
    fingerprints: torch.Tensor  # int64, on the host (filled by a non-blocking copy until `events` complete)
    events: list[Any] = field(default_factory=list)


@dataclass
class ReplicaState:
    """What survives the monitor's collector rebuilds: the settings read at attach, the group,
    the exchange thread, the outcome so far."""

    settings: ReplicaCheckConfig
    off: str | None = None  # why the check is off, once it is
    group: Any = None
    ranks: list[int] = field(default_factory=list)
    group_ranks: list[int] = field(default_factory=list)  # the data-parallel group's ranks, module_ranks or not
    resolved: bool = False
    checks: int = 0
    last: dict[str, Any] | None = None  # this rank's fingerprints at the last check, as hex
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    checked: list[CheckedTensor] = field(default_factory=list)
    skipped: list[SkippedTensor] = field(default_factory=list)
    exchange: ExchangeThread[Job] = field(default_factory=ExchangeThread)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the report file, written from both threads
    warned_edit: bool = False


def replica_state(ctx: StepContext) -> ReplicaState:
    """The monitor's replica check state, made with the settings it had when it attached (kept in
    ctx.kept across collector rebuilds: every rank must keep checking the same steps); an
    escalation (alert.actions), which every rank applies at the same step, changes them."""
    state: ReplicaState | None = ctx.kept.get(KEY)
    current = ctx.config.replica_check
    if state is None:
        state = ctx.kept[KEY] = ReplicaState(settings=current)
    elif current != state.settings and ctx.lockstep_edit:  # an escalation: every rank switches at this step
        state.settings = current
    elif current != state.settings and not state.warned_edit:
        state.warned_edit = True
        logger.warning(
            "msmon[rank %d]: replica_check was edited during the run; the edit takes effect in the next "
            "run (every rank must keep checking the same steps)",
            ctx.rank,
        )
    return state

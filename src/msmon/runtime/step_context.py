"""StepContext: everything a collector may read or do, and nothing more.

Collectors never see TrainerMon, nor does anything else below the api. Each monitor has one
StepContext, the one owner of the live state of the step (which step, whether it is recorded
and with which ops, the step buffer, the monitored parameters, the optimizer adapter and the
shard combiner, the config in force); the step runner (step.py) advances it, and TrainerMon
only shows some of it read-only. A collector reads it through `self.ctx`, puts its rows into
`ctx.buffer`, and reports a failure with `ctx.report_failure(collector, exc)`.
"""

from __future__ import annotations

import logging
import operator
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..config import MonitorConfig
from ..output.repeats import AlertRepeats
from ..stats.ops import with_dependencies
from .actions.board import ActionBoard
from .buffer import StepBuffer
from .cost import CostMeter
from .grad_hooks import GradHooks
from .hook_batch import HookBatch, PendingRow
from .selection import MonitoredParam, Names, names
from .step_collector import MicroSteps, StepCollector
from .tensor_memo import TensorMemo

if TYPE_CHECKING:
    from ..anomaly.dump import AnomalyDumpWriter
    from ..output.handoff import StepConsumer
    from ..seams.spec import Framework

logger = logging.getLogger("msmon")

_GRAD = operator.attrgetter("grad")


def _main_grad(param: torch.Tensor) -> torch.Tensor | None:
    return getattr(param, "main_grad", None)


class StepContext:
    """The state of the monitored step that collectors share (one per monitor)."""

    def __init__(self, rank: int, config: MonitorConfig, output_base: str) -> None:
        self.rank = rank
        self.config = config  # the config in force (a reload replaces it)
        self.output_base = output_base
        self.log_dir: str | None = None  # this rank's output directory
        self.step = 0
        self.recording = False
        # the statistics of this step's rows: the config's ops (ops_written), then those its derived
        # ops (std) are derived from, which pieces combine by and the writer is not handed
        self.step_ops: list[str] = with_dependencies(config.ops)
        self.ops_written: list[str] = list(config.ops)
        self.buffer = StepBuffer()
        self.rows_read: TensorMemo[torch.Tensor | PendingRow] = TensorMemo()  # rows of the tensors read this step
        self.grad_hooks = GradHooks(self)  # one gradient hook per activation tensor and step
        self.hook_batch = HookBatch(self)  # tensors noted in hooks on the device path, read in batches
        self.models: list[torch.nn.Module] = []
        self.params: list[MonitoredParam] = []
        self.adapter: Any = None  # the seams.adapters adapter of the monitored optimizer
        # the ShardCombiner, made at attach (typed Any: collectors hand it Shards their own code types loosely)
        self.shards: Any = None
        self.dp_group: Any = None
        self.tp_group: Any = None
        self.parallel: dict[str, Any] = {}  # the parallel groups' sizes and where they came from (dedupe)
        self.frameworks: Sequence[Framework] = ()  # the framework packages (hooks.frameworks()), set at attach
        self.grad_acc_steps: int | None = config.grad_acc_steps
        self._use_main_grad = False
        # param -> the gradient the optimizer consumes: `.grad`, read by operator.attrgetter (no
        # Python frame per parameter and step), or Megatron's `main_grad` (use_main_grad)
        self.grad_of: Callable[[torch.Tensor], torch.Tensor | None] = _GRAD
        self.tracker: MicroSteps | None = None  # forward/backward micro-steps, when built
        # the step's losses as the script computed them (unscaled, 0-d, on the device, one per
        # micro-step in order), put here by the loss collector (loss_distribution) for a collector
        # that needs them on the device; cleared at the end of every step (the rank comparison reads
        # the loss rows on the host instead: no copy of its own)
        self.losses: list[torch.Tensor] = []
        self.cost = CostMeter()
        self.failed: set[str] = set()  # collectors switched off by a failure (logged once each)
        self.kept: dict[str, Any] = {}  # what a collector keeps across rebuilds (collector key -> state)
        self.anomaly_dump: Callable[[], AnomalyDumpWriter | None] = lambda: None
        # hand a consumer every written step on the writer thread, for the rest of the run
        self.watch_steps: Callable[[StepConsumer], None] = lambda consumer: None
        # the monitor's alerts so far, to log a rule's alert once per tensor (output/repeats.py)
        self.alert_repeats = AlertRepeats(rank)
        self.stop: Callable[[], None] = lambda: None  # close the monitor (a collector ending the run)
        self.alerts_raised: Callable[[], int] = lambda: 0  # this rank's alerts so far (the rules' and collectors')
        # alert.actions: what this rank's readers of a step (the writer, the exchange threads) saw
        self.board = ActionBoard()  # inert until the step's actions make their own (actions/board.py)
        # alert.actions' escalations so far, each appended as it starts (actions/escalate.py's records)
        self.escalations: list[dict[str, Any]] = []
        self.lockstep_edit = False  # the config now applied is switched to by every rank at this step (escalation)
        # what a collector needs done once the monitor is closed and its writer wrote the last step
        self.at_close: list[Callable[[], None]] = []

    def record_ops(self, ops: Sequence[str]) -> None:
        """The statistics of the rows from now on: `ops`, written, and the ops its derived ones
        are derived from (msmon.stats.ops.with_dependencies), carried after them."""
        self.step_ops = with_dependencies(ops)
        self.ops_written = list(ops)

    # -- reading the model ------------------------------------------------------------------------
    def names(self) -> Names:
        """Per chunk: {display name: module}, {display name: parameter}."""
        return names(self.models, self.config.squash_name)

    @property
    def use_main_grad(self) -> bool:
        """Whether gradients are read from `main_grad` (Megatron's buffer) rather than `.grad`."""
        return self._use_main_grad

    @use_main_grad.setter
    def use_main_grad(self, value: bool) -> None:
        self._use_main_grad = value
        self.grad_of = _main_grad if value else _GRAD

    # -- micro-steps ------------------------------------------------------------------------------
    def forward_micro_step(self, chunk: int) -> int:
        return self.tracker.forward_micro(chunk) if self.tracker is not None else 0

    def in_gradless_forward(self, chunk: int) -> bool:
        """Whether the chunk's forward now running has gradients off (it trains nothing)."""
        return self.tracker.in_gradless_forward(chunk) if self.tracker is not None else False

    @property
    def backward_micro_step(self) -> int:
        return self.tracker.backward_micro if self.tracker is not None else 0

    # -- failures ---------------------------------------------------------------------------------
    def report_failure(self, collector: StepCollector, exc: BaseException) -> None:
        """Switch `collector` off (logged once per collector); training continues."""
        collector.enabled = False
        try:
            collector.detach()
        except Exception:
            pass
        if collector.name not in self.failed:
            self.failed.add(collector.name)
            logger.error(
                "msmon[rank %d]: %s monitoring failed at step %d and is switched off; training continues. %s: %s\n%s",
                self.rank,
                collector.name,
                self.step,
                type(exc).__name__,
                exc,
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)),
            )

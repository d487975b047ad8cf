"""The monitored step: what runs when the optimizer steps, and between two steps.

A step is an optimizer step. During it, collectors record statistic rows into a device-side
buffer (hooks launch kernels, nothing synchronises); when the optimizer finishes, the rows are
concatenated, copied to the host once, and handed to the writer thread. Between steps the
config file's identity is checked, so edits take effect at the next step (with sharded
statistics, at the first step every rank has read them: agreement.py).

An iteration whose optimizer step a GradScaler skipped (inf/NaN in the scaled gradients: the
first iterations of fp16 training) is no step: its rows are dropped, every collector forgets it
(`Collector.step_skipped`) and the step number stays, so its backward passes are not counted as
micro-batches of the next step (seams/scaler_steps.py tells such an iteration).

The collectors are built by the caller (the api, which knows the collectors' registry: runtime
sits below the collectors), as a `Built`; the step runs their callbacks, switches off one that
fails, and rebuilds them when the config changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..config import MonitorConfig
from ..seams import grad_rewrites, scaler_steps
from ..seams.listeners import Listening
from ..stats import fused_batch
from ..system.stop import ModuleTree, StopRun, stop_after_struct, stop_with_the_others
from . import selection
from .actions.board import WRITER
from .actions.step_actions import StepActions
from .recording_window import RecordingWindow
from .reload import ConfigReload, output_changed
from .step_collector import StepCollector
from .step_context import StepContext
from .transfer import HostBatch, stage_to_host

if TYPE_CHECKING:  # a type only: the rank's output is built by the api and handed in
    from ..output.rank_output import RankOutput

logger = logging.getLogger("msmon")


@dataclass
class Built:
    """The collectors the config enables, in the order their rows are written, and the two of
    them the step itself asks: how many backward passes a step had (grad_acc_steps, when not
    given) and the module tree (print_struct stops the run after it is written)."""

    collectors: Sequence[StepCollector] = field(default_factory=list)
    micro_steps_seen: Callable[[], int] = lambda: 0
    structure: ModuleTree | None = None
    # {"before_update" / "after_update": the collectors that do something then}, in order; a
    # phase not here runs every collector's (the registry leaves out the base class's no-ops)
    phases: Mapping[str, Sequence[StepCollector]] = field(default_factory=dict)


class StepRunner:
    """One monitor's steps: the optimizer's step hooks, the collectors in force, the end of step."""

    def __init__(
        self,
        ctx: StepContext,
        output: RankOutput,
        reload: ConfigReload,
        build: Callable[[], Built],
        check_fits: Callable[[MonitorConfig], None],
        close: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self.output = output
        self.reload = reload
        self.window = RecordingWindow(ctx.config)
        self._build = build
        self._check_fits = check_fits  # ConfigError unless an edited config's targets name the model
        self._close = close
        self.ops: list[str] = list(ctx.config.ops)  # the statistics of the steps to come
        self.grad_acc_given = ctx.config.grad_acc_steps is not None  # else inferred in the first step
        self.built = Built()
        self.steps_recorded = 0
        self.unhook: Callable[[], None] | None = None
        self.optimizer_steps = 0  # optimizer steps begun: a GradScaler.step call that began none skipped it
        self.skipped = 0  # iterations whose optimizer step a GradScaler skipped
        self._scaler_calls: dict[int, int] = {}  # id(optimizer) -> optimizer_steps when its GradScaler.step began
        self._scaler: Listening | None = None
        # alert.on_nan "stop" and alert.actions, fixed now: every rank must vote at every step (actions/)
        actions = StepActions(ctx, close)
        self.actions = actions if actions.enabled else None

    # -- hooks on the optimizer -----------------------------------------------------------------
    def hook(self, adapter: Any) -> None:
        """Run the collectors around every step of the adapter's optimizer, and see the steps a
        GradScaler skips."""
        self.unhook = adapter.hook_step(self.before_update, self.after_update)
        if self._scaler is None:
            self._scaler = scaler_steps.listen(self._scaler_step_starting, self._scaler_step_ended)
        if self.actions is not None:
            self.actions.attach(adapter)  # skip_step's hooks, after the monitor's own; join contexts followed

    def hook_stop_only(self, adapter: Any) -> None:
        """A rank that records nothing: stop where the recording ranks stop (print_struct,
        cc_log_only), rather than hang in a collective."""
        self.unhook = adapter.hook_step(lambda: None, self._stop_with_the_others)

    def detach(self) -> None:
        """Remove every hook; nothing more is recorded."""
        for collector in self.built.collectors:
            collector.detach()
        self.built = Built()
        self.ctx.hook_batch.clear()  # nothing noted is kept alive past the monitor
        if self.unhook is not None:
            self.unhook()
            self.unhook = None
        if self._scaler is not None:
            self._scaler.stop()
            self._scaler = None
        if self.actions is not None:
            self.actions.detach()
        self.ctx.recording = False

    # -- collectors -----------------------------------------------------------------------------
    def build_collectors(self) -> None:
        """Every collector the config enables, attached."""
        built = self._build()
        for collector in built.collectors:
            collector.attach()
        self.built = built

    def rebuild_collectors(self) -> None:
        """Detach the collectors in force and build them again from the config in force."""
        for collector in self.built.collectors:
            collector.detach()
        self.built = Built()
        self.ctx.hook_batch.clear()
        self.ctx.buffer.clear()
        self.build_collectors()

    def _run_callbacks(self, phase: str) -> None:
        for collector in list(self.built.phases.get(phase, self.built.collectors)):
            if collector.enabled:
                try:
                    getattr(collector, phase)()
                except Exception as exc:
                    self.ctx.report_failure(collector, exc)

    # -- the step -------------------------------------------------------------------------------
    def decide_recording(self) -> None:
        """Whether the step now starting is recorded, and with which statistics."""
        self.ctx.recording = self.window.records(self.ctx.step, self.ctx.config)
        self.ctx.record_ops(self.ops)

    def before_update(self) -> None:
        self.optimizer_steps += 1
        started = time.perf_counter()
        self._run_callbacks("before_update")
        if self.actions is not None:
            self.actions.before_update()  # skip_step: whether every rank holds this step's update back
        self.ctx.cost.seconds += time.perf_counter() - started

    def after_update(self) -> None:
        ctx = self.ctx
        started = time.perf_counter()
        try:
            self._run_callbacks("after_update")
            self._finish_step()
        except StopRun:
            raise
        except Exception as exc:  # the step bookkeeping itself must never break training
            logger.error(
                "msmon[rank %d]: finishing step %d failed: %r; monitoring stops, training continues",
                ctx.rank,
                ctx.step,
                exc,
            )
            self.detach()
        finally:
            ended = time.perf_counter()
            ctx.cost.seconds += ended - started
            ctx.cost.step_ended(ended)

    def _finish_step(self) -> None:
        ctx = self.ctx
        batch = None
        if ctx.recording:
            batch = self._hand_over_rows()
        else:
            ctx.hook_batch.clear()
            ctx.buffer.clear()
        if not self.grad_acc_given and ctx.grad_acc_steps is None:
            seen = self.built.micro_steps_seen()
            if seen:
                ctx.grad_acc_steps = seen
        for collector in self.built.collectors:
            collector.end_step()
        ctx.rows_read.clear()
        ctx.hook_batch.end_step()
        ctx.losses.clear()
        ctx.grad_hooks.clear()
        structure = self.built.structure
        struct_written = structure is not None and structure.enabled and ctx.recording
        trained = ctx.step
        ctx.step += 1  # this step is trained and recorded: a stop's summary.json names the next one
        if self.actions is not None:  # the ranks' vote: on_nan's stop, the actions of the alerts
            self.actions.at_step_end(trained, batch)
        if struct_written and structure is not None:
            stop_after_struct(structure, ctx.output_base, ctx.rank, trained, self._close)
        agreed = self.reload.at_step_end(ctx.shards.take_stamped(), self._check_fits)
        switched = self.actions.config_switch(ctx.step, agreed) if self.actions is not None else agreed
        if switched is not None and switched is agreed:
            self.apply_config(switched)
        elif switched is not None:  # an escalation starts or ends here, on every rank alike
            self.apply_config(switched, "the escalation switched the config", lockstep=True)
        was_recording = ctx.recording
        self.decide_recording()
        if self.window.closed_after(was_recording, ctx.config):
            logger.info(
                "msmon[rank %d]: collected %d steps (collect_times); hooks removed", ctx.rank, self.window.collected
            )
            for collector in self.built.collectors:
                collector.detach()

    def _hand_over_rows(self) -> HostBatch | None:
        """The recorded step's rows: sharded ones combined, all copied to the host once, and
        handed to the writer thread (returned too: alert.on_nan reads it)."""
        ctx = self.ctx
        if ctx.hook_batch.noted:  # tensors noted in hooks since the last batch point (device path)
            ctx.hook_batch.flush()
        if ctx.shards.pending:  # sharded tensors: every rank's piece statistics, combined
            ctx.shards.flush()
        keys, chunks, hists, flag_keys, flags = ctx.buffer.take()
        writer = self.output.writer
        batch = None
        if (keys or hists or flags is not None) and writer is not None:
            ops = ctx.ops_written  # the ops asked for, not the bases carried for a derived one
            if len(ops) < len(ctx.step_ops):
                chunks = [chunk[:, : len(ops)].contiguous() for chunk in chunks]
            batch = stage_to_host(keys, chunks, len(ops), hists, flag_keys, flags)
            ctx.board.expect(WRITER, ctx.step)  # the writer says when it read the step (actions/board.py)
            meta = {"heatmap": True} if ctx.config.heatmap_visualize else None
            if not writer.submit(ctx.step, ops, batch, meta):
                ctx.board.done(WRITER, ctx.step)
        self.window.recorded_one()
        self.steps_recorded += 1
        return batch

    # -- a step a GradScaler skipped ----------------------------------------------------------
    def _steps_this(self, optimizer: Any) -> bool:
        """Whether `optimizer` (or a wrapper that shares its param_groups) is the monitored one."""
        adapter = self.ctx.adapter
        if optimizer is getattr(adapter, "optimizer", None):
            return True
        return bool({id(mp.param) for mp in self.ctx.params} & grad_rewrites.params_of(optimizer))

    def _scaler_step_starting(self, optimizer: Any) -> None:
        try:
            if self._steps_this(optimizer):
                self._scaler_calls[id(optimizer)] = self.optimizer_steps
        except Exception as exc:  # the scaler's call goes on whatever happens here
            self._scaler_failed(exc)

    def _scaler_step_ended(self, optimizer: Any) -> None:
        began = self._scaler_calls.pop(id(optimizer), None)
        if began is None or began != self.optimizer_steps:
            return
        try:
            self.skip_iteration()
        except Exception as exc:
            self._scaler_failed(exc)

    def _scaler_failed(self, exc: Exception) -> None:
        logger.error(
            "msmon[rank %d]: following a GradScaler's step failed: %r; monitoring stops, training continues",
            self.ctx.rank,
            exc,
        )
        self.detach()

    def skip_iteration(self) -> None:
        """The iteration since the last step ended without an optimizer step (a GradScaler found
        inf/NaN in the scaled gradients): its rows are dropped, the collectors forget it, and the
        next iteration starts the same step afresh. Every rank of a DDP job skips alike (the
        reduced gradients hold the same inf), so msmon's per-step collectives stay in step."""
        ctx = self.ctx
        ctx.hook_batch.clear()
        ctx.buffer.clear()
        self._run_callbacks("step_skipped")
        ctx.rows_read.clear()
        ctx.hook_batch.end_step()
        ctx.losses.clear()
        ctx.grad_hooks.clear()
        self.skipped += 1
        if self.skipped == 1:
            logger.info(
                "msmon[rank %d]: a GradScaler skipped the optimizer step before step %d (inf/NaN in the scaled "
                "gradients); an iteration without an optimizer step is no step: its rows are not recorded "
                "(said once)",
                ctx.rank,
                ctx.step,
            )

    def _stop_with_the_others(self) -> None:
        stop_with_the_others(self.ctx.rank, self.ctx.step, self._close)

    # -- config reload --------------------------------------------------------------------------
    def apply_config(self, new: MonitorConfig, what: str = "config reloaded", lockstep: bool = False) -> None:
        """Put the agreed edit (or an escalation's config) in force from the next step on.
        `lockstep`: every rank switches at this step (an escalation): settings fixed at attach
        for want of that (replica_check's) may follow it."""
        ctx = self.ctx
        old = ctx.config
        self._check_fits(new)
        ctx.config = new
        self.ops = list(new.ops)
        if self.output.writer is not None and output_changed(old, new):
            self.output.restart_writer(new)
        if not self.grad_acc_given:
            ctx.grad_acc_steps = ctx.grad_acc_steps if new.grad_acc_steps is None else new.grad_acc_steps
        self.window.reconfigure(old, new, ctx.step)
        ctx.params = selection.monitored_params(new, ctx.models, ctx.adapter, ctx.rank)
        fused_batch.prepare_for([mp.param for mp in ctx.params], self.ops)  # new ops: their kernels now
        ctx.lockstep_edit = lockstep
        try:
            self.rebuild_collectors()
        finally:
            ctx.lockstep_edit = False
        logger.log(
            logging.DEBUG if lockstep else logging.INFO, "msmon[rank %d]: %s at step %d", ctx.rank, what, ctx.step
        )

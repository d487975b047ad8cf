"""TrainerMon: the lifecycle of a monitored step, msprobe-compatible.

A step is an optimizer step. During it, collectors record statistic rows into a device-side
buffer (hooks launch kernels, nothing synchronises); when the optimizer finishes, the rows are
concatenated, copied to the host once, and handed to the writer thread. Between steps the
config file's mtime and size are checked, so edits take effect at the next step (with sharded
statistics, at the first step every rank has read them: agreement.py).

TrainerMon is a facade over one-job modules: the step state collectors share (step_context),
which collectors run (collectors.registry), which steps are recorded (recording_window), the
config hot reload (reload), the rank's output (rank_output) and the early stops (stop).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Generic, TypeVar

import torch

from . import native, stats
from .collectors import registry
from .collectors.activations import TRACKER
from .collectors.base import Collector, MonitoredParam
from .collectors.grads import GradCollector
from .collectors.structure import STRUCT, StructCollector
from .config import ConfigError, MonitorConfig, load_config, parse_ops
from .hooks.pipeline import pipeline_position
from .optimizers import adapter_for
from .optimizers.base import hold_weakly
from .output.directory import ensure_writable, output_base_dir
from .rank_output import RankOutput, report_cost
from .runtime import dedupe, selection
from .runtime.cost import describe
from .runtime.naming import model_chunks
from .runtime.recording_window import RecordingWindow
from .runtime.reload import ConfigReload, output_changed
from .runtime.step_context import StepContext
from .runtime.transfer import stage_to_host
from .system import lifecycle
from .system.distributed import current_rank
from .system.stop import StopAfterStruct, stop_after_struct, stop_with_the_others

logger = logging.getLogger("msmon")

__all__ = ["TrainerMon", "StopAfterStruct"]

T = TypeVar("T")


class _InContext(Generic[T]):
    """A TrainerMon attribute kept in its StepContext (read and written there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, mon: Any, owner: type | None = None) -> T:
        if mon is None:
            return self  # type: ignore[return-value]
        return getattr(mon.ctx, self.name)

    def __set__(self, mon: Any, value: T) -> None:
        setattr(mon.ctx, self.name, value)


class TrainerMon:
    """Monitor a training job; the constructor and methods follow msprobe's TrainerMon."""

    # the step state, shared with the collectors (and read by dedupe, optimizers.shards, the launcher)
    rank: _InContext[int] = _InContext()
    config: _InContext[MonitorConfig] = _InContext()
    step: _InContext[int] = _InContext()
    recording: _InContext[bool] = _InContext()
    step_ops: _InContext[list[str]] = _InContext()
    buffer: _InContext[Any] = _InContext()
    models: _InContext[list[torch.nn.Module]] = _InContext()
    params: _InContext[list[MonitoredParam]] = _InContext()
    adapter: _InContext[Any] = _InContext()
    shards: _InContext[Any] = _InContext()
    dp_group: _InContext[Any] = _InContext()
    tp_group: _InContext[Any] = _InContext()
    grad_acc_steps: _InContext[int | None] = _InContext()
    cost: _InContext[Any] = _InContext()
    output_base: _InContext[str] = _InContext()

    def __init__(
        self,
        config_file_path: str | os.PathLike,
        process_group: Any = None,
        params_have_main_grad: bool | None = None,
        opt_ty: str | None = None,
    ) -> None:
        lifecycle.setup_logging()
        self.config_file_path = os.path.abspath(config_file_path)  # still polled after a chdir
        config = load_config(self.config_file_path)
        self.ctx = StepContext(current_rank(), config, output_base_dir())
        self._reload = ConfigReload(self.config_file_path, self.rank)
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self.opt_ty = opt_ty
        self.active = not config.module_ranks or self.rank in config.module_ranks
        ensure_writable(self.output_base)
        self.output = RankOutput(self.rank, self.output_base, lambda: self.step)
        self.ctx.anomaly_dump = self.output.anomaly_dump
        self.ctx.stop = self.close

        self.steps_recorded = 0
        self._ops: list[str] = list(config.ops)
        self.window = RecordingWindow(config)

        self._optimizer: Any = lambda: None  # held weakly (optimizers.base.hold_weakly)
        self._wrapped_optimizer: Any = None
        self.collectors: list[Collector] = []
        # module-level collection (activations, NaN origin, structure); the launcher turns it off for a
        # second optimizer over a model another monitor already hooks, so its modules are recorded once
        self.records_modules = True
        self._struct: StructCollector | None = None
        self._unhook_step = None
        self._grad_acc_given = config.grad_acc_steps is not None
        self.pp_stage, self.group_mates = 0, [self.rank]
        self.attached = False
        self._closed = False
        if self.active:
            self.output.open(config)
        lifecycle.register(self)

    # -- what the output and the recording window hold ---------------------------------------
    @property
    def log_dir(self) -> str | None:
        return self.output.log_dir

    @property
    def writer(self) -> Any:
        return self.output.writer

    @property
    def output_stopped(self) -> dict | None:
        """The write to disk that failed (output.stopped_output), if one did."""
        return self.output.stopped

    @property
    def collected(self) -> int:
        """Steps recorded since the recording window (re)started."""
        return self.window.collected

    @property
    def _failed(self) -> set[str]:
        return self.ctx.failed

    # -- msprobe API ----------------------------------------------------------------------------
    @property
    def optimizer(self) -> Any:
        """The optimizer given to set_monitor; None before, and once it has been garbage-collected
        (the monitor holds it weakly: it never keeps a script's optimizer alive)."""
        return self._optimizer()

    @property
    def ops(self) -> list[str]:
        return list(self._ops)

    @ops.setter
    def ops(self, value: list[str]) -> None:
        """Change the statistics computed from the next step on (or this one, if nothing of it
        is recorded yet)."""
        self._ops = parse_ops(value)
        if len(self.buffer) == 0:
            self.step_ops = list(self._ops)

    def set_wrapped_optimizer(self, optimizer: Any) -> None:
        self._wrapped_optimizer = optimizer

    def monitor_gnorm_with_ad(
        self,
        model: Any,
        grad_acc_steps: int | None = None,
        optimizer: Any = None,
        dp_group: Any = None,
        tp_group: Any = None,
        start_iteration: int = 0,
    ) -> None:
        optimizer = optimizer if optimizer is not None else self._wrapped_optimizer
        if optimizer is None:
            raise ValueError(
                "msmon: monitor_gnorm_with_ad needs an optimizer: pass optimizer= or call "
                "set_wrapped_optimizer(optimizer) first"
            )
        self.set_monitor(
            model, optimizer, grad_acc_steps, tp_group=tp_group, dp_group=dp_group, start_iteration=start_iteration
        )

    def set_monitor(
        self,
        model: Any,
        optimizer: Any,
        grad_acc_steps: int | None = None,
        tp_group: Any = None,
        dp_group: Any = None,
        start_iteration: int = 0,
    ) -> None:
        """Attach to a model (or a list of virtual-pipeline chunks) and its optimizer.

        grad_acc_steps: micro-batches per optimizer step; None infers it from the number of
        backward passes seen in the first step.
        """
        if self.attached:
            raise RuntimeError("msmon: this TrainerMon is already attached; create one TrainerMon per optimizer")
        self.models = model_chunks(model)
        self._optimizer = hold_weakly(optimizer)
        self.tp_group, self.dp_group = tp_group, dp_group
        self.step = int(start_iteration)
        if grad_acc_steps is not None and not self._grad_acc_given:
            if not isinstance(grad_acc_steps, int) or grad_acc_steps < 1:
                raise ConfigError(f"grad_acc_steps: expected a positive integer, got {grad_acc_steps!r}")
            self.grad_acc_steps = grad_acc_steps
            self._grad_acc_given = True
        self.pp_stage, self.group_mates = pipeline_position(self.process_group)
        selection.check_targets(self.config, self.models)
        self.adapter = adapter_for(optimizer, self.opt_ty)
        self.params = selection.monitored_params(self.config, self.models, self.adapter, self.rank)
        self.ctx.use_main_grad = selection.decide_main_grad(self.params, self.params_have_main_grad)
        self.shards = dedupe.attach(self, dp_group, tp_group)  # who writes what: decided once, here
        self._reload.attach(self)  # ranks combining shards switch configs together
        if self.output.resume is not None:  # append_output: where the earlier run's series continues
            self.step = self.output.resume.begin(self.step, self.writer.sinks if self.writer else ())
        self.attached = True
        if not self.active:
            logger.info(
                "msmon[rank %d]: not in module_ranks %s; this rank records nothing", self.rank, self.config.module_ranks
            )
            if self.config.print_struct or self.config.cc_distribution.cc_log_only:
                # the recording ranks stop after step 0: stop with them rather than hang in a collective
                self._unhook_step = self.adapter.hook_step(lambda: None, self._stop_with_the_others)
            return
        self._unhook_step = self.adapter.hook_step(self._before_update, self._after_update)
        native.prepare()  # find or build the kernel before the first step rather than inside a hook
        stats.configure_threads()  # MSMON_STAT_THREADS / MSMON_NATIVE_THREADS as the job set them
        self._build_collectors()
        self._decide_recording()
        self.cost.attached()

    def generate_wgrad_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(reduced, unreduced) weight-gradient statistics of the last recorded step:
        {tag: {op: value}}."""
        return self._api_metrics("grad_reduced"), self._api_metrics("grad_unreduced")

    def generate_xy_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(activations, activation gradients) of the last recorded step: {tag: {op: value}}."""
        return self._api_metrics("actv"), self._api_metrics("actv_grad")

    def generate_param_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(before, after the update) weight statistics of the last recorded step."""
        return self._api_metrics("param_origin"), self._api_metrics("param_updated")

    def generate_mv_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(exp_avg, exp_avg_sq) statistics of the last recorded step."""
        return self._api_metrics("exp_avg"), self._api_metrics("exp_avg_sq")

    def reload_xy(self, xy_distribution: bool = True) -> None:
        """Switch activation monitoring on or off from the next forward on."""
        self.config.xy_distribution = bool(xy_distribution)
        if self.attached and self.active:
            self._rebuild_collectors()

    # -- lifecycle ------------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove every hook; the monitor records nothing more."""
        for collector in self.collectors:
            collector.detach()
        self.collectors = []
        if self._unhook_step is not None:
            self._unhook_step()
            self._unhook_step = None
        self.recording = False

    def close(self) -> None:
        """Detach, write what is pending and a summary; safe to call more than once."""
        self.detach()
        if self.writer is not None and not self._closed:
            self._closed = True
            self.writer.close()
            self.output.write_summary(self.summary())
            if self.steps_recorded or self.cost.steps:
                report_cost(
                    self.rank,
                    f"msmon[rank {self.rank}]: {self.steps_recorded} steps recorded; {describe(self.summary())}",
                )

    def summary(self) -> dict[str, Any]:
        """What the run recorded and what the monitor cost (also written to summary.json)."""
        return {
            "rank": self.rank,
            "output_dir": self.log_dir,
            "steps_recorded": self.steps_recorded,
            "alerts": self.writer.alerts_raised if self.writer else 0,
            "first_nonfinite": self.writer.first_origin if self.writer else None,
            **self.cost.report(self.writer.cpu_seconds if self.writer else None),
            "last_step": self.step,
            "output_stopped": self.output_stopped,
            **({"note": note} if (note := self._nothing_recorded_because()) else {}),
        }

    def _nothing_recorded_because(self) -> str | None:
        """Why a monitor recorded no step (summary.json and the launcher's line say it)."""
        if self.steps_recorded:
            return None
        if not self.attached:
            return "set_monitor was never called: no optimizer was monitored"
        if self.cost.steps == 0:
            return "no optimizer step ran"
        return (
            f"{self.cost.steps} optimizer steps ran, none of them in the steps the config records "
            "(start_step, step_interval, collect_times, dynamic_on)"
        )

    @property
    def monitor_seconds(self) -> float:
        """Wall time spent in monitor code on the training thread so far."""
        return self.cost.seconds

    def _api_metrics(self, category: str) -> dict[str, dict[str, float]]:
        return self.output.metrics(category)

    # -- collectors -----------------------------------------------------------------------------
    def _build_collectors(self) -> None:
        """Every collector the config enables, in the registry's order (the order rows are written)."""
        self.ctx.log_dir = self.log_dir
        self.output.enable_dump(self.config, self.pp_stage, self.group_mates)
        self.ctx.tracker = None
        collectors = registry.build(self.ctx, hook_modules=self.records_modules)
        self.ctx.tracker = registry.find(collectors, TRACKER)  # type: ignore[assignment]
        self._struct = registry.find(collectors, STRUCT)  # type: ignore[assignment]
        for collector in collectors:
            collector.attach()
        self.collectors = collectors

    def _rebuild_collectors(self) -> None:
        for collector in self.collectors:
            collector.detach()
        self.collectors = []
        self.buffer.clear()
        self._build_collectors()

    # -- the step -------------------------------------------------------------------------------
    def _decide_recording(self) -> None:
        self.recording = self.window.records(self.step, self.config)
        self.step_ops = list(self._ops)

    def _run_callbacks(self, phase: str) -> None:
        for collector in list(self.collectors):
            if collector.enabled:
                try:
                    getattr(collector, phase)()
                except Exception as exc:
                    self.ctx.report_failure(collector, exc)

    def _before_update(self) -> None:
        started = time.perf_counter()
        self._run_callbacks("before_update")
        self.cost.seconds += time.perf_counter() - started

    def _after_update(self) -> None:
        started = time.perf_counter()
        try:
            self._run_callbacks("after_update")
            self._finish_step()
        except StopAfterStruct:
            raise
        except Exception as exc:  # the step bookkeeping itself must never break training
            logger.error(
                "msmon[rank %d]: finishing step %d failed: %r; monitoring stops, training continues",
                self.rank,
                self.step,
                exc,
            )
            self.detach()
        finally:
            ended = time.perf_counter()
            self.cost.seconds += ended - started
            self.cost.step_ended(ended)

    def _finish_step(self) -> None:
        if self.recording:
            self.shards.flush()  # sharded tensors: every rank's piece statistics, combined
            keys, chunks, hists, flag_keys, flags = self.buffer.take()
            if (keys or hists or flags is not None) and self.writer is not None:
                batch = stage_to_host(keys, chunks, len(self.step_ops), hists, flag_keys, flags)
                self.writer.submit(
                    self.step, self.step_ops, batch, {"heatmap": True} if self.config.heatmap_visualize else None
                )
            self.window.recorded_one()
            self.steps_recorded += 1
        else:
            self.buffer.clear()
        grads = next((c for c in self.collectors if isinstance(c, GradCollector)), None)
        if not self._grad_acc_given and self.grad_acc_steps is None and grads is not None:
            seen = grads.micro_steps_seen()
            if seen:
                self.grad_acc_steps = seen
        for collector in self.collectors:
            collector.end_step()
        self.ctx.rows_read.clear()
        self.ctx.grad_hooks.clear()
        if self._struct is not None and self._struct.enabled and self.recording:
            stop_after_struct(self._struct, self.output_base, self.rank, self.step, self.close)
        self.step += 1
        agreed = self._reload.at_step_end(self.shards.take_stamped(), self._check_fits)
        if agreed is not None:
            self._apply_config(agreed)
        was_recording = self.recording
        self._decide_recording()
        if self.window.closed_after(was_recording, self.config):
            logger.info("msmon[rank %d]: collected %d steps (collect_times); hooks removed", self.rank, self.collected)
            for collector in self.collectors:
                collector.detach()

    def _stop_with_the_others(self) -> None:
        stop_with_the_others(self.rank, self.step, self.close)

    # -- config reload --------------------------------------------------------------------------
    def _check_fits(self, new: MonitorConfig) -> None:
        """ConfigError unless every target of `new` names a module or parameter of the model."""
        selection.check_targets(new, self.models)

    def _apply_config(self, new: MonitorConfig) -> None:
        """Put the agreed edit in force from the next step on."""
        old = self.config
        selection.check_targets(new, self.models)
        self.config = new
        self._ops = list(new.ops)
        if self.writer is not None and output_changed(old, new):
            self.output.restart_writer(new)
        if not self._grad_acc_given:
            self.grad_acc_steps = self.grad_acc_steps if new.grad_acc_steps is None else new.grad_acc_steps
        self.window.reconfigure(old, new, self.step)
        self.params = selection.monitored_params(new, self.models, self.adapter, self.rank)
        self._rebuild_collectors()
        logger.info("msmon[rank %d]: config reloaded at step %d", self.rank, self.step)

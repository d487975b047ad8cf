"""TrainerMon: msmon's msprobe-compatible API, a facade over one-job modules.

The step state collectors share is the step context's (runtime/step_context.py), what runs
at each optimizer step and between steps is the step runner's (runtime/step.py), which collectors
run is the collectors' registry's (collectors/registry.py), which steps are recorded the recording
window's, the config hot reload runtime/reload.py's, the rank's output rank_output's, the early
stops system/stop.py's. TrainerMon holds only what the API itself is given (the config file, the
optimizer, process_group, opt_ty) and answers the API's calls from those modules.
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import torch

from .collectors import registry
from .collectors.base import Collector, MonitoredParam
from .config import ConfigError, MonitorConfig, load_config, parse_ops
from .output.directory import ensure_writable, output_base_dir
from .output.rank_output import RankOutput, report_cost
from .output.sinks import check_formats
from .runtime import dedupe, selection
from .runtime.actions.board import WRITER
from .runtime.cost import describe
from .runtime.job_facts import job_facts
from .runtime.naming import model_chunks
from .runtime.reload import ConfigReload
from .runtime.shards import ShardCombiner
from .runtime.step import Built, StepRunner
from .runtime.step_context import StepContext
from .seams.adapter_choice import adapter_for
from .seams.adapters import hold_weakly
from .seams.pipeline import pipeline_position
from .seams.registry import frameworks
from .stats import fused_batch, native, threads
from .system import lifecycle
from .system.distributed import current_rank
from .system.environment import ENV_BOOTSTRAP_DIR
from .system.stop import StopAfterStruct

logger = logging.getLogger("msmon")

__all__ = ["TrainerMon", "StopAfterStruct"]


class TrainerMon:
    """Monitor a training job; the constructor and methods follow msprobe's TrainerMon."""

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
        check_formats(config, self.config_file_path)
        self.ctx = StepContext(current_rank(), config, output_base_dir())
        rank = self.ctx.rank
        if config.translation and rank == 0 and not os.environ.get(ENV_BOOTSTRAP_DIR):  # msmon run prints it
            for line in config.translation:
                logger.info("msmon: %s", line)
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self.opt_ty = opt_ty
        self.active = not config.module_ranks or rank in config.module_ranks
        ensure_writable(self.ctx.output_base)
        self.output = RankOutput(rank, self.ctx.output_base, lambda: self.ctx.step)
        self.ctx.anomaly_dump = self.output.anomaly_dump
        self.ctx.watch_steps = self.output.watch_steps
        self.ctx.alert_repeats = self.output.repeats
        self.ctx.alerts_raised = lambda: self.output.alerts_raised
        self.ctx.stop = self.close
        reload = ConfigReload(self.config_file_path, rank)
        self.runner = StepRunner(self.ctx, self.output, reload, self._build_collectors, self._check_fits, self.close)
        board = self.ctx.board  # alert.actions: the writer tells the vote what it saw and read
        self.output.seen, self.output.step_done = board.saw, lambda step: board.done(WRITER, step)

        self._optimizer: Any = lambda: None  # held weakly (seams.adapters.hold_weakly)
        self._wrapped_optimizer: Any = None
        # module-level collection (activations, NaN origin, structure); the launcher turns it off for a
        # second optimizer over a model another monitor already hooks, so its modules are recorded once
        self.records_modules = True
        self.pp_stage, self.group_mates = 0, [rank]
        self.attached = False
        self._job: dict[str, Any] | None = None  # summary.json's "job", read at attach
        self._closed = False
        if self.active:
            self.output.open(config)
        lifecycle.register(self)

    # -- read-only views of what the step context, the step runner and the output own ------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def config(self) -> MonitorConfig:
        """The config in force (a reload replaces it)."""
        return self.ctx.config

    @property
    def step(self) -> int:
        return self.ctx.step

    @property
    def models(self) -> list[torch.nn.Module]:
        return self.ctx.models

    @property
    def params(self) -> list[MonitoredParam]:
        return self.ctx.params

    @property
    def adapter(self) -> Any:
        """The seams.adapters adapter of the monitored optimizer (None before set_monitor)."""
        return self.ctx.adapter

    @property
    def output_base(self) -> str:
        return self.ctx.output_base

    @property
    def collectors(self) -> list[Collector]:
        return cast("list[Collector]", self.runner.built.collectors)  # the ones _build_collectors built

    @property
    def steps_recorded(self) -> int:
        return self.runner.steps_recorded

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
        return self.runner.window.collected

    @property
    def monitor_seconds(self) -> float:
        """Wall time spent in monitor code on the training thread so far."""
        return self.ctx.cost.seconds

    # -- msprobe API ----------------------------------------------------------------------------
    @property
    def optimizer(self) -> Any:
        """The optimizer given to set_monitor; None before, and once it has been garbage-collected
        (the monitor holds it weakly: it never keeps a script's optimizer alive)."""
        return self._optimizer()

    @property
    def ops(self) -> list[str]:
        return list(self.runner.ops)

    @ops.setter
    def ops(self, value: list[str]) -> None:
        """Change the statistics computed from the next step on (or this one, if nothing of it
        is recorded yet)."""
        self.runner.ops = parse_ops(value)
        if self.attached:
            fused_batch.prepare_for([mp.param for mp in self.ctx.params], self.runner.ops)
        if len(self.ctx.buffer) == 0:
            self.ctx.record_ops(self.runner.ops)

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
        ctx, runner = self.ctx, self.runner
        ctx.models = model_chunks(model)
        self._optimizer = hold_weakly(optimizer)
        ctx.tp_group, ctx.dp_group = tp_group, dp_group
        ctx.step = int(start_iteration)
        if grad_acc_steps is not None and not runner.grad_acc_given:
            if not isinstance(grad_acc_steps, int) or grad_acc_steps < 1:
                raise ConfigError(f"grad_acc_steps: expected a positive integer, got {grad_acc_steps!r}")
            ctx.grad_acc_steps = grad_acc_steps
            runner.grad_acc_given = True
        self.pp_stage, self.group_mates = pipeline_position(self.process_group)
        ctx.board.pp_stage = self.pp_stage
        self._check_fits(ctx.config)
        ctx.adapter = adapter_for(optimizer, self.opt_ty)
        ctx.params = selection.monitored_params(ctx.config, ctx.models, ctx.adapter, ctx.rank)
        ctx.use_main_grad = selection.decide_main_grad(ctx.params, self.params_have_main_grad)
        ctx.frameworks = frameworks()
        combinable = dedupe.decide_writers(ctx, ctx.frameworks, dp_group, tp_group)  # who writes what: decided once
        ctx.shards = ShardCombiner(ctx, enabled=combinable)
        runner.reload.attach(ctx.shards, ctx.adapter)  # ranks combining shards switch configs together
        if self.output.resume is not None:  # append_output: where the earlier run's series continues
            ctx.step = self.output.resume.begin(ctx.step, self.writer.sinks if self.writer else ())
        self.attached = True
        self._job = job_facts(ctx, self.pp_stage)
        if not self.active:
            logger.info(
                "msmon[rank %d]: not in module_ranks %s; this rank records nothing", ctx.rank, ctx.config.module_ranks
            )
            if ctx.config.print_struct or ctx.config.cc_distribution.cc_log_only:
                runner.hook_stop_only(ctx.adapter)  # the recording ranks stop after step 0: stop with them
            return
        runner.hook(ctx.adapter)
        native.prepare()  # find or build the kernel before the first step rather than inside a hook
        fused_batch.prepare_for([p.param for p in ctx.params], runner.ops)  # the accelerator path's, likewise
        threads.configure_threads()  # MSMON_STAT_THREADS / MSMON_NATIVE_THREADS as the job set them
        runner.build_collectors()
        runner.decide_recording()
        ctx.cost.attached()

    def generate_wgrad_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(reduced, unreduced) weight-gradient statistics of the last recorded step:
        {tag: {op: value}}."""
        return self.output.metrics("grad_reduced"), self.output.metrics("grad_unreduced")

    def generate_xy_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(activations, activation gradients) of the last recorded step: {tag: {op: value}}."""
        return self.output.metrics("actv"), self.output.metrics("actv_grad")

    def generate_param_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(before, after the update) weight statistics of the last recorded step."""
        return self.output.metrics("param_origin"), self.output.metrics("param_updated")

    def generate_mv_metrics(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(exp_avg, exp_avg_sq) statistics of the last recorded step."""
        return self.output.metrics("exp_avg"), self.output.metrics("exp_avg_sq")

    def reload_xy(self, xy_distribution: bool = True) -> None:
        """Switch activation monitoring on or off from the next forward on."""
        self.ctx.config.xy_distribution = bool(xy_distribution)
        self.rebuild_collectors()

    def rebuild_collectors(self) -> None:
        """Build the collectors again (after a change of config or of records_modules); nothing
        to do before set_monitor or on a rank that records nothing."""
        if self.attached and self.active:
            self.runner.rebuild_collectors()

    # -- lifecycle ------------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove every hook; the monitor records nothing more."""
        self.runner.detach()

    def close(self) -> None:
        """Detach, write what is pending and a summary; safe to call more than once."""
        self.detach()
        if self.writer is not None and not self._closed:
            self._closed = True
            self.writer.close()
            for finish in self.ctx.at_close:  # after the last step was written and consumed
                try:
                    finish()
                except Exception as exc:  # never raised at the end of a run
                    logger.warning("msmon[rank %d]: closing failed: %r", self.rank, exc)
            self.output.repeats.log_summary()  # one line per rule and tensor that alerted again
            if self.runner.actions is not None:
                self.runner.actions.close()  # notifications still queued: a bounded wait
            self.output.write_summary(self.summary())
            if self.steps_recorded or self.ctx.cost.steps:
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
            "alerts": self.output.alerts_raised,
            "first_nonfinite": self.output.first_origin,
            **self.ctx.cost.report(self.writer.cpu_seconds if self.writer else None),
            "last_step": self.step - 1 if self.step > 0 else None,  # the last step trained
            "next_step": self.step,
            "output_stopped": self.output_stopped,
            **(self.runner.actions.summary(self.step - 1 if self.step > 0 else None) if self.runner.actions else {}),
            **({"job": {**self._job, "grad_acc_steps": self.ctx.grad_acc_steps}} if self._job is not None else {}),
            **({"note": note} if (note := self._nothing_recorded_because()) else {}),
        }

    def _nothing_recorded_because(self) -> str | None:
        """Why a monitor recorded no step (summary.json and the launcher's line say it)."""
        if self.steps_recorded:
            return None
        if not self.attached:
            return "set_monitor was never called: no optimizer was monitored"
        if self.ctx.cost.steps == 0:
            return "no optimizer step ran"
        return (
            f"{self.ctx.cost.steps} optimizer steps ran, none of them in the steps the config records "
            "(start_step, step_interval, collect_times, dynamic_on)"
        )

    # -- what the runtime is handed: the collectors and the config's fit to the model -------------
    def _build_collectors(self) -> Built:
        """Every collector the config enables, in the registry's order (the order rows are written)."""
        ctx = self.ctx
        ctx.log_dir = self.log_dir
        self.output.enable_dump(ctx.config, self.pp_stage, self.group_mates)
        return registry.build(ctx, hook_modules=self.records_modules)

    def _check_fits(self, new: MonitorConfig) -> None:
        """ConfigError unless every target of `new` names a module or parameter of the model."""
        selection.check_targets(new, self.ctx.models, registry.target_checks())

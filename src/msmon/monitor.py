"""TrainerMon: the lifecycle of a monitored step, msprobe-compatible.

A step is an optimizer step. During it, collectors record statistic rows into a device-side
buffer (hooks launch kernels, nothing synchronises); when the optimizer finishes, the rows are
concatenated, copied to the host once, and handed to the writer thread. Between steps the
config file's mtime and size are checked, so edits take effect at the next step (with sharded
statistics, at the first step every rank has read them: agreement.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from typing import Any

import torch

from . import agreement, dedupe, lifecycle, native, resume
from .anomaly.dump import AnomalyDumpWriter
from .anomaly.rules import RuleEngine, build_rules
from .collectors import (
    ActivationCollector,
    Collector,
    GradCollector,
    MicroStepTracker,
    MonitoredParam,
    OptimizerStateCollector,
    ParamCollector,
    StructCollector,
)
from .collectors.l2_features import L2FeatureCollector, resolve_targets
from .collectors.nan_origin import NanOriginCollector
from .collectors.sync_grads import SyncGradCollector
from .config import ConfigError, MonitorConfig, TensorSpec, load_config, parse_ops
from .cost import CostMeter, describe
from .distributed import current_rank, pipeline_position
from .launcher.boot import ENV_BOOTSTRAP_DIR
from .naming import check_targets, covers, display, model_chunks, split_vpp
from .optimizers import adapter_for
from .optimizers.base import hold_weakly
from .output import ensure_writable, output_base_dir, rank_dir_name, stopped_line, stopped_output
from .records import StepBuffer
from .sinks import ApiSink, make_sinks
from .sinks.writer import BackgroundWriter
from .transfer import stage_to_host

logger = logging.getLogger("msmon")


class StopAfterStruct(SystemExit):
    """Raised after print_struct wrote the module tree: a clean stop (exit code 0)."""


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
        self.config_file_path = os.fspath(config_file_path)
        self.config: MonitorConfig = load_config(self.config_file_path)
        self._config_ident = _identity(self.config_file_path)  # the file version in force (or proposed)
        self._bad_config_ident: tuple[int, ...] | None = None  # the last version found invalid
        self._agreement = agreement.ConfigAgreement()  # over the shard groups once attached
        self.process_group = process_group
        self.params_have_main_grad = params_have_main_grad
        self.opt_ty = opt_ty
        self.rank = current_rank()
        self.active = not self.config.module_ranks or self.rank in self.config.module_ranks
        self.output_base = output_base_dir()
        ensure_writable(self.output_base)
        self.log_dir: str | None = None
        self._resume: resume.Resume | None = None  # append_output: continuing an earlier run's directory
        self.writer: BackgroundWriter | None = None
        self.output_stopped: dict | None = None  # the write to disk that failed (output.stopped_output)
        self._api: ApiSink | None = None

        self.step = 0
        self.collected = 0
        self.steps_recorded = 0
        self.recording = False
        self.step_ops: list[str] = list(self.config.ops)
        self._ops: list[str] = list(self.config.ops)
        self._window_start = self.config.start_step
        if os.environ.get("DYNAMIC_MONITOR", "").lower() in ("1", "true") and not self.config.dynamic_on:
            self._window_start = None  # msprobe's dynamic mode: wait for dynamic_on in the file

        self.models: list[torch.nn.Module] = []
        self._optimizer: Any = lambda: None  # held weakly (optimizers.base.hold_weakly)
        self.adapter: Any = None
        self._wrapped_optimizer: Any = None
        self.params: list[MonitoredParam] = []
        self.collectors: list[Collector] = []
        self._tracker: MicroStepTracker | None = None
        # module-level collection (activations, NaN origin, structure); the launcher turns it off for a
        # second optimizer over a model another monitor already hooks, so its modules are recorded once
        self.records_modules = True
        self._struct: StructCollector | None = None
        self._unhook_step = None
        self.grad_acc_steps: int | None = self.config.grad_acc_steps
        self._grad_acc_given = self.config.grad_acc_steps is not None
        self._use_main_grad = False
        self.buffer = StepBuffer()
        self.pp_stage, self.group_mates = 0, [self.rank]
        self.cost = CostMeter()
        self._failed: set[str] = set()
        self.attached = False
        self._closed = False
        if self.active:
            self._open_output()
        lifecycle.register(self)

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
        self._check_targets()
        self.adapter = adapter_for(optimizer, self.opt_ty)
        self.params = self._monitored_params()
        self._use_main_grad = self._decide_main_grad()
        self.shards = dedupe.attach(self, dp_group, tp_group)  # who writes what: decided once, here
        self._agreement = agreement.for_monitor(self)  # ranks combining shards switch configs together
        if self._resume is not None:  # append_output: where the earlier run's series continues
            self.step = self._resume.begin(self.step, self.writer.sinks if self.writer else ())
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
            self._write_summary()
            self._report_cost()

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

    # -- internals used by collectors -----------------------------------------------------------
    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        if self._use_main_grad:
            return getattr(param, "main_grad", None)
        return param.grad

    def forward_micro_step(self, chunk: int) -> int:
        return self._tracker.forward_micro(chunk) if self._tracker is not None else 0

    def in_gradless_forward(self, chunk: int) -> bool:
        """Whether the chunk's forward now running has gradients off (it trains nothing)."""
        return self._tracker.in_gradless_forward(chunk) if self._tracker is not None else False

    @property
    def backward_micro_step(self) -> int:
        return self._tracker.backward_micro if self._tracker is not None else 0

    def _contain_failure(self, collector: Collector, exc: BaseException) -> None:
        collector.enabled = False
        try:
            collector.detach()
        except Exception:
            pass
        if collector.name not in self._failed:
            self._failed.add(collector.name)
            logger.error(
                "msmon[rank %d]: %s monitoring failed at step %d and is switched off; training continues. %s: %s\n%s",
                self.rank,
                collector.name,
                self.step,
                type(exc).__name__,
                exc,
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3)),
            )

    # -- setup ----------------------------------------------------------------------------------
    def _open_output(self) -> None:
        try:
            self.log_dir, self._resume = resume.open_rank_dir(self.output_base, self.rank, self.config.append_output)
        except OSError as exc:
            self.log_dir = os.path.join(self.output_base, rank_dir_name(self.rank))
            self._output_failed(exc, self.log_dir)
        self._start_writer()

    def _start_writer(self) -> None:
        """The writer and its sinks; once a write to disk failed, only the in-memory API sink."""
        cfg = self.config
        assert self.log_dir is not None
        sinks = []
        if self.output_stopped is None:
            config_path = os.path.join(self.log_dir, "config.json")
            try:
                with open(config_path, "w", encoding="utf-8") as fh:
                    json.dump(cfg.raw, fh, indent=2)
                sinks = make_sinks(cfg.format, self.log_dir, cfg.ndigits, cfg.step_count_per_record)
            except OSError as exc:
                self._output_failed(exc, config_path)
        self._api = next((s for s in sinks if isinstance(s, ApiSink)), None)
        if self._api is None:  # the generate_*_metrics API works whatever the format
            self._api = ApiSink()
            sinks.append(self._api)
        rules = RuleEngine(build_rules(cfg.alert.rules))
        self.writer = BackgroundWriter(
            sinks, self.rank, rules, None, cfg.alert.max_lines_per_step, on_output_stopped=self._output_stopped
        )

    def _output_failed(self, exc: OSError, path: str) -> None:
        """Setting the output up failed (a full disk): one line, and nothing is written to disk."""
        self._output_stopped(stopped_output(self.step, exc, path))
        logger.error(stopped_line(self.rank, self.output_stopped))

    def _output_stopped(self, info: dict) -> None:
        if self.output_stopped is None:
            self.output_stopped = info

    def _enable_dump(self) -> None:
        if self.output_stopped is not None:
            return
        if self.writer is not None and self.config.alert.dump and self.writer.dump is None:
            self.writer.dump = AnomalyDumpWriter(self.output_base, self.rank, self.pp_stage, self.group_mates)

    def _names(self):
        squash = self.config.squash_name
        modules = [{display(n, squash): m for n, m in chunk.named_modules()} for chunk in self.models]
        params = [{display(n, squash): p for n, p in chunk.named_parameters()} for chunk in self.models]
        return modules, params

    def _check_targets(self) -> None:
        modules, params = self._names()
        check_targets(self.config.targets, [set(m) for m in modules], [set(p) for p in params])
        if self.config.recording_l2_features:
            resolve_targets(self.config, modules)  # l2_targets naming no module: a ConfigError here too

    def _targets_for(self, chunk: int) -> list[str]:
        out = []
        for target in self.config.targets:
            vpp, name = split_vpp(target)
            if vpp is None or vpp == chunk:
                out.append(name)
        return out

    def _monitored_params(self) -> list[MonitoredParam]:
        owned = {id(p) for p in self.adapter.params()}
        _, params = self._names()
        expand = getattr(self.adapter, "named_params", None)  # one flat parameter, several originals (FSDP1)
        if expand is not None:
            params = expand(params)
        chosen: list[MonitoredParam] = []
        seen: set[int] = set()
        for chunk, named in enumerate(params):
            targets = self._targets_for(chunk) or [""]
            for name, p in named.items():
                if id(p) in seen or (owned and id(p) not in owned):
                    continue
                if any(covers(t, name) for t in targets):
                    seen.add(id(p))
                    chosen.append(MonitoredParam(name, chunk, p))
        cfg = self.config
        if not chosen and (cfg.wg_distribution or cfg.param_distribution or cfg.mv_distribution or cfg.ur_distribution):
            reason = (
                "no parameter matches the targets"
                if any(id(p) in owned for named in params for p in named.values())
                else "the optimizer owns no parameter of the given model"
            )
            logger.warning("msmon[rank %d]: %s; weights, gradients and moments are not recorded", self.rank, reason)
        return chosen

    def _decide_main_grad(self) -> bool:
        has_main = any(hasattr(mp.param, "main_grad") for mp in self.params)
        if self.params_have_main_grad is None:
            return has_main
        if self.params_have_main_grad and self.params and not has_main:
            raise ConfigError(
                "params_have_main_grad=True, but the model's parameters have no `main_grad` "
                "attribute (that is Megatron's gradient buffer); pass params_have_main_grad=False "
                "or leave it out to detect it"
            )
        return bool(self.params_have_main_grad)

    def _xy_targets(self) -> list[tuple[torch.nn.Module, str, int, int, dict[str, TensorSpec]]]:
        cfg = self.config
        modules, _ = self._names()
        out = []
        for chunk, named in enumerate(modules):
            targets = {
                name: cfg.targets.get(t, {})
                for t in cfg.targets
                for v, name in [split_vpp(t)]
                if v is None or v == chunk
            }
            select_all = cfg.all_xy or "" in targets or not cfg.targets
            for name, module in named.items():
                if name == "":
                    continue
                if select_all or name in targets:
                    out.append((module, name, chunk, chunk, targets.get(name, {})))
        return out

    def _build_collectors(self) -> None:
        cfg = self.config
        self._enable_dump()
        collectors: list[Collector] = []
        hook_modules = self.records_modules  # False: another monitor hooks these models' modules
        l2_targets = resolve_targets(cfg, self._names()[0]) if hook_modules and cfg.recording_l2_features else []
        needs_tracker = hook_modules and (
            cfg.xy_enabled or cfg.print_struct or cfg.nan_origin_enabled or bool(l2_targets)
        )
        self._tracker = MicroStepTracker(self, self.models) if needs_tracker else None
        if self._tracker is not None:
            collectors.append(self._tracker)
        if hook_modules and cfg.print_struct:
            modules, _ = self._names()
            listed = [
                (m, (f"{c}:{n}" if len(self.models) > 1 else n))
                for c, named in enumerate(modules)
                for n, m in named.items()
                if n
            ]
            self._struct = StructCollector(self, listed)
            collectors.append(self._struct)
        if hook_modules and cfg.nan_origin_enabled:
            modules, _ = self._names()
            collectors.append(
                NanOriginCollector(
                    self, [(m, n, c, c) for c, named in enumerate(modules) for n, m in named.items() if n]
                )
            )
        if hook_modules and cfg.stack_info:
            from .collectors.stack_info import StackInfoCollector

            modules, _ = self._names()
            collectors.append(
                StackInfoCollector(self, [(m, f"{c}:{n}") for c, named in enumerate(modules) for n, m in named.items()])
            )
        if hook_modules and cfg.xy_enabled:
            collectors.append(ActivationCollector(self, self._xy_targets()))
        if l2_targets:
            collectors.append(L2FeatureCollector(self, l2_targets))
        if cfg.wg_distribution and self.adapter.hooks_unreduced:  # rank-local grads at the bucket's grad sync
            collectors.append(SyncGradCollector(self))
        if cfg.wg_distribution:
            collectors.append(GradCollector(self))
        if cfg.param_distribution:
            collectors.append(ParamCollector(self))
        if cfg.mv_distribution or cfg.ur_distribution or cfg.mg_direction:
            collectors.append(OptimizerStateCollector(self))
        if cfg.cc_distribution.enable:
            from .collectors.comm import CommCollector

            collectors.append(CommCollector(self))
        from .collectors.replica_check import replica_collector

        replica = replica_collector(self)  # settings as at attach: every rank checks the same steps
        if replica is not None:
            collectors.append(replica)
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
        start = self._window_start
        cfg = self.config
        self.recording = (
            start is not None
            and self.step >= start
            and (self.step - start) % cfg.step_interval == 0
            and self.collected < cfg.collect_times
        )
        self.step_ops = list(self._ops)

    def _run_callbacks(self, phase: str) -> None:
        for collector in list(self.collectors):
            if collector.enabled:
                try:
                    getattr(collector, phase)()
                except Exception as exc:
                    self._contain_failure(collector, exc)

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
            if (keys or hists or flags) and self.writer is not None:
                batch = stage_to_host(keys, chunks, len(self.step_ops), hists, flag_keys, flags)
                self.writer.submit(
                    self.step, self.step_ops, batch, {"heatmap": True} if self.config.heatmap_visualize else None
                )
            self.collected += 1
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
        if self._struct is not None and self._struct.enabled and self.recording:
            self._finish_struct()
        self.step += 1
        self._maybe_reload_config()
        was_recording = self.recording
        self._decide_recording()
        if was_recording and self.collected >= self.config.collect_times and not self.config.dynamic_on:
            logger.info("msmon[rank %d]: collected %d steps (collect_times); hooks removed", self.rank, self.collected)
            for collector in self.collectors:
                collector.detach()

    def _finish_struct(self) -> None:
        assert self._struct is not None
        path = self._struct.write(self.output_base)
        if self.rank == 0 or not torch.distributed.is_initialized():
            print(self._struct.render_tree(), flush=True)
        self.close()
        print(
            f"msmon: module structure of rank {self.rank} written to {path}; stopping after step "
            f"{self.step} as print_struct asks",
            flush=True,
        )
        raise StopAfterStruct(0)

    def _stop_with_the_others(self) -> None:
        self.close()
        print(f"msmon: rank {self.rank} stops after step {self.step} with the recording ranks", flush=True)
        raise StopAfterStruct(0)

    def _maybe_reload_config(self) -> None:
        """At a step's end: complete this step's agreement round, look for a new edit of the
        file, and apply the edit the ranks agreed on (agreement.py; without sharded statistics,
        the edit just read)."""
        self._agreement.end_round(self.shards.take_stamped())
        edit = self._read_edit()
        if edit is not None:
            self._agreement.propose(edit)
        agreed = self._agreement.decide()
        if agreed is not None:
            self._apply_config(agreed)

    def _read_edit(self) -> MonitorConfig | None:
        """The config file's new version, validated against the model, or None: unchanged
        (same mtime and size: a `stat`, nothing more), missing, changing while read, or known
        to be bad. A bad version, whatever is wrong with it, is logged once in one line and
        leaves the config in force alone; a later version is read again."""
        path = self.config_file_path
        ident = _identity(path)
        if ident is None or ident == self._config_ident or ident == self._bad_config_ident:
            return None
        try:
            new = load_config(path, allow_empty=False)  # empty: an editor half-way through writing it
            self._check_fits(new)
        except Exception as exc:
            failure: BaseException | None = exc
        else:
            failure = None
        if _identity(path) != ident:
            return None  # written to while read: read it again at the next step
        if failure is not None:
            self._bad_config_ident = ident
            logger.error(
                "msmon[rank %d]: the edited config is invalid and is ignored (the previous config stays in force): %s",
                self.rank,
                _one_line(failure),
            )
            return None
        self._config_ident, self._bad_config_ident = ident, None
        return new

    def _check_fits(self, new: MonitorConfig) -> None:
        """ConfigError unless every target of `new` names a module or parameter of the model."""
        old, self.config = self.config, new
        try:
            self._check_targets()
        finally:
            self.config = old

    def _apply_config(self, new: MonitorConfig) -> None:
        old = self.config
        self.config = new
        try:
            self._check_targets()
        except ConfigError:
            self.config = old
            raise
        self._ops = list(new.ops)
        output_keys = ("format", "ndigits", "step_count_per_record", "alert")
        if self.writer is not None and any(getattr(new, k) != getattr(old, k) for k in output_keys):
            previous = self.writer
            previous.close()  # writes what is pending with the old sinks
            self._start_writer()
            self.writer.steps_written, self.writer.alerts_raised = previous.steps_written, previous.alerts_raised
            self.writer.first_origin = previous.first_origin
        if not self._grad_acc_given:
            self.grad_acc_steps = self.grad_acc_steps if new.grad_acc_steps is None else new.grad_acc_steps
        if (
            new.dynamic_on
            or new.start_step != old.start_step
            or new.step_interval != old.step_interval
            or new.collect_times != old.collect_times
        ):
            self._window_start = max(new.start_step, self.step) if new.dynamic_on else new.start_step
            self.collected = 0
        self.params = self._monitored_params()
        self._rebuild_collectors()
        logger.info("msmon[rank %d]: config reloaded at step %d", self.rank, self.step)

    def _api_metrics(self, category: str) -> dict[str, dict[str, float]]:
        if self.writer is not None:
            self.writer.drain()
        return self._api.metrics(category) if self._api is not None else {}

    def _report_cost(self) -> None:
        """Tell the user what monitoring cost. Under `msmon run` the launcher prints every rank's
        line at the end of the job. With the API, every rank logs its line to the "msmon" logger
        at INFO when logging is set up for it; otherwise rank 0 prints its line on stderr (every
        rank's is in its summary.json either way)."""
        if self.steps_recorded == 0 and self.cost.steps == 0:
            return
        line = f"msmon[rank {self.rank}]: {self.steps_recorded} steps recorded; {describe(self.summary())}"
        if os.environ.get(ENV_BOOTSTRAP_DIR):
            logger.debug(line)
        elif logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
            logger.info(line)
        elif self.rank == 0:
            print(line, file=sys.stderr, flush=True)

    def _write_summary(self) -> None:
        if self.log_dir is None:
            return
        path = os.path.join(self.log_dir, "summary.json")
        tmp = path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self.summary(), fh, indent=2)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.remove(tmp)
            except OSError:
                pass
            if self.output_stopped is None:
                logger.warning("msmon[rank %d]: could not write %s: %s", self.rank, path, exc)
            else:  # its cause is said already, and the launcher has it from the worker record
                logger.debug("msmon[rank %d]: could not write %s: %s", self.rank, path, exc)


def _identity(path: str) -> tuple[int, ...] | None:
    """What tells one version of a file from the next: mtime, size and inode (two writes in
    one mtime tick differ in size; an editor's save-by-rename makes a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _one_line(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())

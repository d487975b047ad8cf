"""msprobe V2 configs (26.2's TrainerMonitorV2: `monitors`, `rank`, `stop_step`, ...) read unchanged.

A mapping with `monitors` is a V2 config. It is translated here into msmon's keys, one line per
V2 key saying what it became (`msmon run` prints them, as TrainerMon does on rank 0), and the
result is validated like any msmon config. What V2 means, read from msprobe 26.2.0's
monitor_v2 package, and what it becomes:

- `monitors.module` (on unless `enabled: false`; V2 turns on no other monitor by default):
  `xy_distribution`; its `targets`, substrings of module names, become `xy_name_contains` (every
  module whose name contains one, matched against the model when the monitor attaches); none:
  every module. `weight_grad`: `wg_distribution` (`monitor_mbs_grad`, and `micro_batch_number`
  or `grad_acc_steps` as `grad_acc_steps`); `param`: `param_distribution`; `optimizer`:
  `mv_distribution`; `cc`: `cc_distribution` (flat or nested under `cc_distribution`).
- Each monitor's `ops` (V2's default: min, max, mean, norm, nans) stay that monitor's: `ops` is
  their union and `category_ops` gives each monitor's categories their own.
- `rank`, an int or a list ([]: every rank): `module_ranks`. `start_step`, `step_interval`,
  `step_count_per_record` as they are. V2 records `start_step <= step < stop_step`: `stop_step`
  becomes the `collect_times` that ends there; V2's `collect_times: 0` means no limit.
- `format` (V2: "csv" only, its default): `format`; msmon's own format names are taken too.
- `framework` must be PyTorch's; `output_dir`, `async_write` and `patch_optimizer_step` have no
  msmon meaning (msmon writes where `--output-dir` or MONITOR_OUTPUT_DIR say, always off the
  training thread, at the optimizer's step): a line says so.
- msmon's own keys (`alert`, `tracker`, ...) pass through, unless the translation sets them.

Every mistake (a MindSpore framework, an unknown monitor or key, a wrong type) is one line
naming the key. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from ..system.short_repr import short_repr
from .errors import ConfigError, did_you_mean
from .ops import parse_ops
from .schema import VALID_KEYS

MARKER = "monitors"
DEFAULT_OPS = ["min", "max", "mean", "norm", "nans"]  # V2's, when a monitor names none
FRAMEWORKS = {"pytorch": "pytorch", "pt": "pytorch", "torch": "pytorch", "mindspore": "mindspore", "ms": "mindspore"}
TOP_KEYS = (
    "framework",
    "output_dir",
    "rank",
    "start_step",
    "step_interval",
    "step_count_per_record",
    "collect_times",
    "stop_step",
    "monitors",
    "format",
    "async_write",
    "patch_optimizer_step",
)
UNUSED = {
    "output_dir": "msmon writes where --output-dir or MONITOR_OUTPUT_DIR say",
    "async_write": "msmon always writes off the training thread",
    "patch_optimizer_step": "msmon's step is the optimizer's step",
}
CC_KEYS = ("cc_codeline", "cc_log_only", "cc_pre_hook")


@dataclass(frozen=True)
class Monitor:
    """A V2 monitor: the categories its rows fall in, its own keys."""

    categories: tuple[str, ...]
    keys: tuple[str, ...]


COMMON = ("enabled", "ops", "eps")
MONITORS = {
    "module": Monitor(("actv", "actv_grad"), (*COMMON, "targets")),
    "weight_grad": Monitor(
        ("grad_unreduced", "grad_reduced"),
        (*COMMON, "monitor_mbs_grad", "micro_batch_number", "grad_acc_steps"),
    ),
    "param": Monitor(("param_origin", "param_updated"), (*COMMON, "param_distribution")),
    "optimizer": Monitor(("exp_avg", "exp_avg_sq"), (*COMMON, "mv_distribution")),
    "cc": Monitor(("other",), (*COMMON, *CC_KEYS, "module_ranks", "cc_distribution")),
}
ExpectInt = Callable[[str, Any, int], int]


@dataclass
class Translation:
    config: dict[str, Any] = field(default_factory=dict)  # msmon's keys
    lines: list[str] = field(default_factory=list)  # "v2 key -> what it became", one per key

    def say(self, v2_key: str, text: str) -> None:
        self.lines.append(f"msprobe V2 {v2_key} -> {text}")


def is_v2(data: Any) -> bool:
    return isinstance(data, Mapping) and MARKER in data


def translate(data: Mapping[str, Any], expect_int: ExpectInt) -> Translation:
    """msmon's mapping for a V2 config, and one line per V2 key. `expect_int(where, value,
    minimum)` is the config's integer check."""
    out = Translation()
    _framework(data.get("framework", "pytorch"))
    for key in data:
        if key not in TOP_KEYS and key not in VALID_KEYS:
            raise ConfigError(
                f"unknown msprobe V2 config key {short_repr(key)}{did_you_mean(key, TOP_KEYS + VALID_KEYS)}; "
                f"V2 keys are {', '.join(TOP_KEYS)}"
            )
    if "framework" in data:
        out.say("framework", "PyTorch, the framework msmon monitors")
    for key, why in UNUSED.items():
        if key in data:
            out.say(key, f"not used: {why}")
    _ranks(data, out)
    _window(data, out, expect_int)
    _format(data, out)
    _monitors(data[MARKER], out, expect_int)
    for key, value in data.items():
        if key in TOP_KEYS:
            continue
        if key in out.config:
            raise ConfigError(
                f"{key}: an msprobe V2 config sets it through `monitors`; leave it out or write an msmon config"
            )
        out.config[key] = value
        out.say(key, f"{key}, msmon's own key, as it is")
    return out


def _framework(value: Any) -> None:
    name = FRAMEWORKS.get(str(value).strip().lower())
    if name == "mindspore":
        raise ConfigError(
            f"framework: {short_repr(value)} is MindSpore; msmon monitors PyTorch jobs (msprobe's TrainerMonitorV2 "
            "serves MindSpore)"
        )
    if name is None:
        raise ConfigError(f"framework: unknown framework {short_repr(value)}; expected 'pytorch' (or 'pt', 'torch')")


def _ranks(data: Mapping[str, Any], out: Translation) -> None:
    if "rank" not in data:
        return
    value = data["rank"]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        ranks = [value]
    elif isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value):
        ranks = list(dict.fromkeys(value))
    else:
        raise ConfigError(f"rank: expected a rank number or a list of them ([] every rank), got {short_repr(value)}")
    out.config["module_ranks"] = ranks
    out.say("rank", f"module_ranks {ranks}" + (" (every rank)" if not ranks else ""))


def _window(data: Mapping[str, Any], out: Translation, expect_int: ExpectInt) -> None:
    """start_step, step_interval, step_count_per_record as they are; stop_step (exclusive) and
    collect_times (0: no limit) as the one collect_times that ends where V2 ends."""
    for key, minimum in (("start_step", 0), ("step_interval", 1), ("step_count_per_record", 1)):
        if key in data:
            out.config[key] = expect_int(key, data[key], minimum)
            out.say(key, f"{key} {out.config[key]}")
    start, interval = out.config.get("start_step", 0), out.config.get("step_interval", 1)
    limit: int | None = None
    if "collect_times" in data:
        times = expect_int("collect_times", data["collect_times"], 0)
        limit = times or None
        out.say("collect_times", f"collect_times {times}" if times else "no limit (V2's collect_times 0)")
    if "stop_step" in data:
        stop = expect_int("stop_step", data["stop_step"], start)
        steps = math.ceil((stop - start) / interval)
        limit = steps if limit is None else min(limit, steps)
        out.say(
            "stop_step",
            f"collect_times {limit}: steps {start} <= step < {stop}" + (f" every {interval}" if interval > 1 else ""),
        )
    if limit is not None:
        out.config["collect_times"] = limit


def _format(data: Mapping[str, Any], out: Translation) -> None:
    value = data.get("format", "csv")
    formats = [value.strip().lower()] if isinstance(value, str) else value
    out.config["format"] = formats
    out.say("format", f"format {short_repr(formats)}" + ("" if "format" in data else " (V2 writes CSV)"))


def _monitors(value: Any, out: Translation, expect_int: ExpectInt) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(f"monitors: expected an object {{monitor: {{...}}}}, got {short_repr(value)}")
    ops_of: dict[str, list[str]] = {}
    for name, settings in value.items():
        where = f"monitors.{name}"
        monitor = MONITORS.get(name)
        if monitor is None:
            raise ConfigError(
                f"{where}: unknown monitor {short_repr(name)}{did_you_mean(name, MONITORS)}; expected {list(MONITORS)}"
            )
        if not isinstance(settings, Mapping):
            raise ConfigError(f'{where}: expected an object like {{"enabled": true}}, got {short_repr(settings)}')
        for key in settings:
            if key not in monitor.keys:
                raise ConfigError(
                    f"{where}: unknown key {short_repr(key)}{did_you_mean(key, monitor.keys)}; "
                    f"expected {list(monitor.keys)}"
                )
        enabled = settings.get("enabled", name == "module")
        if not isinstance(enabled, bool):
            raise ConfigError(f"{where}.enabled: expected true or false, got {short_repr(enabled)}")
        if not enabled:
            out.say(where, "off" + ("" if "enabled" in settings else " (V2 turns on only `module` by default)"))
            continue
        ops_of[name] = parse_ops(settings["ops"], f"{where}.ops") if "ops" in settings else list(DEFAULT_OPS)
        _MONITOR_KEYS[name](settings, out, where, expect_int)
        if "eps" in settings:
            out.say(f"{where}.eps", "not used: no V2 op reads it (msmon's `eps` is the zeros op's)")
    _ops(ops_of, out)


def _ops(ops_of: dict[str, list[str]], out: Translation) -> None:
    """`ops` the union of the monitors' ops, `category_ops` each monitor's own where they differ."""
    union = list(dict.fromkeys(op for ops in ops_of.values() for op in ops)) or list(DEFAULT_OPS)
    out.config["ops"] = union
    category_ops: dict[str, list[str]] = {}
    for name, ops in ops_of.items():
        own = set(ops) != set(union)
        kept = f"category_ops {ops} for {', '.join(MONITORS[name].categories)}" if own else "every op"
        if own:
            category_ops.update({c: list(ops) for c in MONITORS[name].categories})
        out.say(f"monitors.{name}.ops", f"ops {union}, {kept}")
    if category_ops:
        out.config["category_ops"] = category_ops


def _bool(settings: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = settings.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: expected true or false, got {short_repr(value)}")
    return value


def _module(settings: Mapping[str, Any], out: Translation, where: str, expect_int: ExpectInt) -> None:
    targets = settings.get("targets", [])
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{where}.targets: expected a list of module-name substrings, got {short_repr(targets)}")
    out.config["xy_distribution"] = True
    if targets:
        out.config["xy_name_contains"] = list(targets)
        out.say(
            where,
            f"xy_distribution true, xy_name_contains {short_repr(targets)}: the inputs, outputs and their gradients "
            "of every module whose name contains one of them (matched against the model when the monitor attaches)",
        )
    else:
        out.say(where, "xy_distribution true: the inputs, outputs and their gradients of every module")


def _weight_grad(settings: Mapping[str, Any], out: Translation, where: str, expect_int: ExpectInt) -> None:
    out.config["wg_distribution"] = True
    out.config["monitor_mbs_grad"] = _bool(settings, "monitor_mbs_grad", where, False)
    text = f"wg_distribution true, monitor_mbs_grad {str(out.config['monitor_mbs_grad']).lower()}"
    for key in ("micro_batch_number", "grad_acc_steps"):  # V2 takes the first one given
        if key in settings:
            out.config["grad_acc_steps"] = expect_int(f"{where}.{key}", settings[key], 1)
            text += f", grad_acc_steps {out.config['grad_acc_steps']}"
            break
    out.say(where, text)


def _param(settings: Mapping[str, Any], out: Translation, where: str, expect_int: ExpectInt) -> None:
    out.config["param_distribution"] = _bool(settings, "param_distribution", where, True)
    out.say(where, f"param_distribution {str(out.config['param_distribution']).lower()}")


def _optimizer(settings: Mapping[str, Any], out: Translation, where: str, expect_int: ExpectInt) -> None:
    out.config["mv_distribution"] = _bool(settings, "mv_distribution", where, True)
    out.say(where, f"mv_distribution {str(out.config['mv_distribution']).lower()}")


def _cc(settings: Mapping[str, Any], out: Translation, where: str, expect_int: ExpectInt) -> None:
    nested = settings.get("cc_distribution", settings)  # V2 reads a nested cc_distribution first
    if not isinstance(nested, Mapping):
        raise ConfigError(f"{where}.cc_distribution: expected an object, got {short_repr(nested)}")
    if nested is not settings:
        for key in nested:
            if key not in (*CC_KEYS, "module_ranks"):
                raise ConfigError(
                    f"{where}.cc_distribution: unknown key {short_repr(key)}{did_you_mean(key, CC_KEYS)}; "
                    f"expected {list(CC_KEYS)}"
                )
    cc: dict[str, Any] = {"enable": True}
    cc.update({key: nested[key] for key in CC_KEYS if key in nested})
    out.config["cc_distribution"] = cc
    text = f"cc_distribution {short_repr(cc)}"
    if "module_ranks" in nested:
        text += "; its module_ranks not used: the ranks that record are the top-level `rank`"
    out.say(where, text)


_MONITOR_KEYS: dict[str, Callable[[Mapping[str, Any], Translation, str, ExpectInt], None]] = {
    "module": _module,
    "weight_grad": _weight_grad,
    "param": _param,
    "optimizer": _optimizer,
    "cc": _cc,
}

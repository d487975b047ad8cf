"""Load and validate the monitor config (JSON or YAML) before training starts.

The keys, their types and defaults are declared in schema.py; this module checks a mapping
against them and resolves it into a MonitorConfig. Every mistake is reported with the key, what
was expected and what was given; unknown keys get the closest valid name. Keys that msprobe
knows but msmon does not implement are accepted with a warning, so an msprobe config never
fails silently or loudly for nothing.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from ..system.short_repr import short_repr
from . import v2
from .errors import ConfigError, did_you_mean
from .ops import check_category_ops, parse_category_ops, parse_ops
from .schema import (
    ALERT_RULES,
    BOOL_KEYS,
    INT_KEYS,
    L2_HOOKS,
    MSPROBE_ONLY_KEYS,
    ON_NAN,
    SA_ORDERS,
    TARGET_SLOTS,
    TENSORBOARD_LAYOUTS,
    VALID_KEYS,
    AlertConfig,
    AlertRuleConfig,
    CCConfig,
    MonitorConfig,
    ReplicaCheckConfig,
    TensorSpec,
    keys_of,
)
from .time_range import parse_time_range
from .tracker import parse_tracker

logger = logging.getLogger("msmon")


def _type_name(value: Any) -> str:
    return type(value).__name__


def _expect_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {short_repr(value)} ({_type_name(value)})")
    return value


def _expect_int(key: str, value: Any, minimum: int) -> int:
    """An integer; an integral float too (`1e8`, the notation the docs use for collect_times,
    is a float in JSON)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected an integer, got {short_repr(value)} (not a finite number)")
        if value.is_integer():
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {short_repr(value)} ({_type_name(value)})")
    if value < minimum:
        raise ConfigError(f"{key}: expected an integer >= {minimum}, got {value}")
    return value


def _expect_positive(key: str, value: Any) -> float:
    """A finite number > 0: NaN would compare false everywhere and switch a check off silently."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a positive number, got {short_repr(value)} ({_type_name(value)})")
    if not math.isfinite(value):
        raise ConfigError(f"{key}: expected a positive number, got {short_repr(value)} (not a finite number)")
    if value <= 0:
        raise ConfigError(f"{key}: expected a positive number, got {short_repr(value)}")
    return float(value)


def _parse_format(value: Any) -> list[str]:
    """The shape of `format` only: which names are formats is the output's to say (a sink file
    each), checked by `msmon.output.sinks.check_formats` where the config is loaded for use."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"format: expected an output format's name or a list of them, got {short_repr(value)}")
    return list(dict.fromkeys(items))


def _parse_targets(value: Any) -> dict[str, dict[str, TensorSpec]]:
    if not isinstance(value, dict):
        raise ConfigError(f"targets: expected an object {{module_or_param_name: {{...}}}}, got {short_repr(value)}")
    targets: dict[str, dict[str, TensorSpec]] = {}
    for name, spec in value.items():
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise ConfigError(
                f'targets[{short_repr(name)}]: expected an object like {{"input": "tuple[2]:0"}}, '
                f"got {short_repr(spec)}"
            )
        parsed: dict[str, TensorSpec] = {}
        for slot, text in spec.items():
            if slot not in TARGET_SLOTS:
                raise ConfigError(
                    f"targets[{short_repr(name)}]: unknown key {short_repr(slot)}; expected {list(TARGET_SLOTS)}"
                    f"{did_you_mean(slot, TARGET_SLOTS)}"
                )
            parsed[slot] = TensorSpec.parse(text, f"targets[{short_repr(name)}][{short_repr(slot)}]")
        targets[name] = parsed
    return targets


def _parse_l2_targets(value: Any) -> dict[str, list[str]]:
    """{hook: [module names]}; `"linear_hook": []` selects every module with a 2-D weight."""
    if not isinstance(value, dict):
        raise ConfigError(
            f"l2_targets: expected an object {{hook: [module names]}} with hooks from {list(L2_HOOKS)}, "
            f"got {short_repr(value)}"
        )
    targets: dict[str, list[str]] = {}
    for hook, names in value.items():
        if hook not in L2_HOOKS:
            raise ConfigError(
                f"l2_targets: unknown hook {short_repr(hook)}; expected {list(L2_HOOKS)}"
                + did_you_mean(str(hook), L2_HOOKS)
            )
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(
                f"l2_targets[{short_repr(hook)}]: expected a list of module names, got {short_repr(names)}"
            )
        targets[hook] = list(dict.fromkeys(names))
    return targets


def _parse_sa_order(value: Any) -> str:
    order = value.replace(" ", "") if isinstance(value, str) else value
    if order not in SA_ORDERS:
        raise ConfigError(
            f"sa_order: expected one of {list(SA_ORDERS)} (the layout of the attention hook's q and "
            f"k: s=sequence, b=batch, h=heads, d=head dim), got {short_repr(value)}"
        )
    return order


def _parse_tensorboard_layout(value: Any) -> str:
    if value not in TENSORBOARD_LAYOUTS:
        raise ConfigError(
            f"tensorboard_layout: expected one of {list(TENSORBOARD_LAYOUTS)} (msprobe: the rank in every tag; "
            f"by_rank: tags without the rank, one TensorBoard run per rank), got {short_repr(value)}"
        )
    return str(value)


def _parse_cc(value: Any) -> CCConfig:
    if not isinstance(value, dict):
        raise ConfigError(f"cc_distribution: expected an object, got {short_repr(value)}")
    cc = CCConfig()
    for key, item in value.items():
        where = f"cc_distribution.{key}"
        if key == "cc_codeline":
            if not isinstance(item, list) or not all(isinstance(v, str) for v in item):
                raise ConfigError(f'{where}: expected a list of strings like "train.py[23]", got {short_repr(item)}')
            for pattern in item:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ConfigError(f"{where}: {short_repr(pattern)} is not a valid pattern: {exc}") from None
            cc.cc_codeline = list(item)
        elif key in ("enable", "cc_pre_hook", "cc_log_only"):
            setattr(cc, key, _expect_bool(where, item))
        else:
            raise ConfigError(f"cc_distribution: unknown key {short_repr(key)}{did_you_mean(key, keys_of(CCConfig))}")
    return cc


def _parse_alert(value: Any) -> AlertConfig:
    if not isinstance(value, dict):
        raise ConfigError(f'alert: expected an object {{"rules": [...], "dump": false}}, got {short_repr(value)}')
    alert = AlertConfig()
    for key, item in value.items():
        if key == "dump":
            alert.dump = _expect_bool("alert.dump", item)
        elif key == "max_lines_per_step":
            alert.max_lines_per_step = _expect_int("alert.max_lines_per_step", item, 0)
        elif key == "on_nan":
            if item not in ON_NAN:
                raise ConfigError(f"alert.on_nan: expected one of {list(ON_NAN)}, got {short_repr(item)}")
            alert.on_nan = item
        elif key == "inform":
            logger.warning("msmon: alert.inform (messaging) is not supported; alerts are logged and dumped")
        elif key == "rules":
            if not isinstance(item, list):
                raise ConfigError(f"alert.rules: expected a list, got {short_repr(item)}")
            for i, rule in enumerate(item):
                alert.rules.append(_parse_rule(rule, f"alert.rules[{i}]"))
        else:
            raise ConfigError(f"alert: unknown key {short_repr(key)}{did_you_mean(key, keys_of(AlertConfig))}")
    return alert


def _parse_replica_check(value: Any) -> ReplicaCheckConfig:
    if not isinstance(value, dict):
        raise ConfigError(
            f'replica_check: expected an object {{"enable": true, "every": 100, "grads": false}}, '
            f"got {short_repr(value)}"
        )
    check = ReplicaCheckConfig()
    for key, item in value.items():
        if key in ("enable", "grads"):
            setattr(check, key, _expect_bool(f"replica_check.{key}", item))
        elif key == "every":
            check.every = _expect_int("replica_check.every", item, 1)
        else:
            raise ConfigError(
                f"replica_check: unknown key {short_repr(key)}{did_you_mean(str(key), keys_of(ReplicaCheckConfig))}; "
                "expected 'enable', 'every' and 'grads'"
            )
    return check


def _parse_rule(rule: Any, where: str) -> AlertRuleConfig:
    if not isinstance(rule, dict) or "rule_name" not in rule:
        raise ConfigError(
            f'{where}: expected {{"rule_name": ..., "args": {{"threshold": ...}}}}, got {short_repr(rule)}'
        )
    name = rule["rule_name"]
    if name not in ALERT_RULES:
        raise ConfigError(
            f"{where}.rule_name: unknown rule {short_repr(name)}; "
            f"expected {list(ALERT_RULES)}{did_you_mean(str(name), ALERT_RULES)}"
        )
    extra = set(rule) - {"rule_name", "args"}
    if extra:
        raise ConfigError(f"{where}: unknown key {short_repr(sorted(extra)[0])}; expected 'rule_name' and 'args'")
    args = rule.get("args") or {}
    if not isinstance(args, dict) or set(args) - {"threshold"}:
        raise ConfigError(f'{where}.args: expected {{"threshold": number}}, got {short_repr(args)}')
    threshold = args.get("threshold")
    if threshold is None and name == "AnomalyTurbulence":
        raise ConfigError(f"{where}.args.threshold: AnomalyTurbulence needs a threshold (e.g. 0.5)")
    if threshold is not None:
        threshold = _expect_positive(f"{where}.args.threshold", threshold)
    return AlertRuleConfig(name, threshold)


def parse_config(data: Mapping[str, Any]) -> MonitorConfig:
    """Validate a config mapping; raises ConfigError on the first mistake."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected an object at the top level, got {_type_name(data)}")
    cfg = MonitorConfig(raw=copy.deepcopy(dict(data)))
    if v2.is_v2(data):  # msprobe's TrainerMonitorV2 config: read as the msmon keys it means
        translation = v2.translate(data, _expect_int)
        data, cfg.translation = translation.config, translation.lines
    for key, value in data.items():
        if key in MSPROBE_ONLY_KEYS:
            logger.warning(
                "msmon: config key %r (%s) is an msprobe feature msmon does not implement; it has no effect",
                key,
                MSPROBE_ONLY_KEYS[key],
            )
        elif key in BOOL_KEYS:
            setattr(cfg, key, _expect_bool(key, value))
        elif key in INT_KEYS:
            setattr(cfg, key, _expect_int(key, value, INT_KEYS[key]))
        elif key == "targets":
            cfg.targets = _parse_targets(value)
        elif key == "module_ranks":
            if not isinstance(value, list):
                raise ConfigError(f"module_ranks: expected a list of rank numbers, got {short_repr(value)}")
            try:
                cfg.module_ranks = [_expect_int(f"module_ranks[{i}]", v, 0) for i, v in enumerate(value)]
            except ConfigError as exc:
                raise ConfigError(
                    f"module_ranks: expected a list of rank numbers, got {short_repr(value)} ({exc})"
                ) from None
        elif key == "cc_distribution":
            cfg.cc_distribution = _parse_cc(value)
        elif key == "alert":
            cfg.alert = _parse_alert(value)
        elif key == "format":
            cfg.format = _parse_format(value)
        elif key == "tensorboard_layout":
            cfg.tensorboard_layout = _parse_tensorboard_layout(value)
        elif key == "ops":
            cfg.ops = parse_ops(value)
        elif key == "category_ops":
            cfg.category_ops = parse_category_ops(value)
        elif key == "eps":
            cfg.eps = _expect_positive(key, value)
        elif key == "grad_acc_steps":
            cfg.grad_acc_steps = None if value is None else _expect_int(key, value, 1)
        elif key == "nan_origin":
            cfg.nan_origin = _expect_bool(key, value)
        elif key == "append_output":
            cfg.append_output = parse_time_range(value)
        elif key == "mg_distribution":  # msprobe validates this name as a bool but never reads it
            _expect_bool(key, value)
            logger.warning(
                "msmon: config key 'mg_distribution' has no effect (msprobe checks it but never reads it); "
                "the gradient/momentum direction key is 'mg_direction'"
            )
        elif key in ("l2_targets", "sa_order"):
            setattr(cfg, key, _parse_l2_targets(value) if key == "l2_targets" else _parse_sa_order(value))
        elif key == "replica_check":
            cfg.replica_check = _parse_replica_check(value)
        elif key == "tracker":
            cfg.tracker = parse_tracker(value, _expect_int)
        elif key == "xy_name_contains":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"xy_name_contains: expected a list of non-empty strings, got {short_repr(value)}")
            cfg.xy_name_contains = list(dict.fromkeys(value))
        else:
            raise ConfigError(
                f"unknown config key {short_repr(key)}{did_you_mean(key, VALID_KEYS)}; "
                f"valid keys are {', '.join(VALID_KEYS)}"
            )
    check_category_ops(cfg.category_ops, cfg.ops)
    if cfg.recording_l2_features != bool(cfg.l2_targets):
        why = (
            "recording_l2_features is true but l2_targets names no hook"
            if cfg.recording_l2_features
            else "l2_targets is set but recording_l2_features is not true"
        )
        logger.warning("msmon: %s; no L2 feature is recorded", why)
    if cfg.heatmap_visualize and not (cfg.ur_distribution and "tensorboard" in cfg.format):
        why = "ur_distribution is not true" if not cfg.ur_distribution else "format has no 'tensorboard'"
        logger.warning(
            "msmon: heatmap_visualize draws the ur_distribution histograms into TensorBoard, but %s; "
            "no heatmap is drawn",
            why,
        )
    if cfg.grad_agreement and not cfg.wg_distribution:
        logger.warning(
            "msmon: grad_agreement compares the gradients wg_distribution reads, but wg_distribution is not "
            "true; no gradient agreement is recorded"
        )
    if cfg.forward_only and cfg.backward_only:
        logger.warning("msmon: forward_only and backward_only are both true: no activation is recorded")
    return cfg


def read_config_file(path: str | os.PathLike, allow_empty: bool = True) -> dict[str, Any]:
    """Read a JSON or YAML file into a mapping, with one-line errors that name the file (and
    the line and column of a bad byte, a full-width comma or a syntax error). An empty YAML
    file is the default config, unless `allow_empty` is False (a file edited while training
    runs, which is empty while the editor writes it)."""
    from .text import parse_config_bytes

    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if not allow_empty and not data.strip():
        raise ConfigError(f"config file {path} is empty (is it still being written?)")
    parsed = parse_config_bytes(data, path)
    if parsed is None and not allow_empty:
        raise ConfigError(f"config file {path} holds no config (is it still being written?)")
    return {} if parsed is None else parsed


def load_config(path: str | os.PathLike, allow_empty: bool = True) -> MonitorConfig:
    """Read and validate a config file; every problem is a one-line ConfigError."""
    try:
        return parse_config(read_config_file(path, allow_empty))
    except ConfigError as exc:
        if str(path) in str(exc):
            raise
        raise ConfigError(f"{path}: {exc}") from None
    except RecursionError:  # copying or checking a document nested thousands deep
        raise ConfigError(f"{path}: the config nests too deeply to be a monitor config") from None

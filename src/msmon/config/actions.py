"""`alert.actions`: what the ranks do together when an alert fires (runtime/actions/ carries it out).

Each entry is `{"on": [...], "do": ..., ...}`: `on` names rules (alert.rules', NanOrigin,
ReplicaMismatch) and verdicts (`verdict:<code>`, the kind of fault anomaly/fault_kind.py tells),
`do` is escalate, skip_step, stop or notify, and each action has its own keys. Every mistake is
one line naming the entry and the key, with the closest name where one was mistyped; what needs
the whole config (a rule that is not in alert.rules, an escalation's config) is checked once the
rest is read (`check_actions`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..system.short_repr import short_repr
from .errors import ConfigError, did_you_mean
from .resolved import resolved
from .schema import (
    ACTION_RULES,
    ACTIONS,
    ALERT_RULES,
    VERDICT_CODES,
    VERDICT_PREFIX,
    ActionConfig,
    MonitorConfig,
)

COMMON_KEYS = ("on", "do")
KEYS_OF = {
    "escalate": ("for_steps", "config"),
    "skip_step": ("max_per_run",),
    "stop": ("repeat_limit",),
    "notify": ("url", "command", "timeout", "retries"),
}
# keys an escalation may not change: who records, where and how rows are written, the window's start,
# and the alert section itself (the actions in force)
FIXED_KEYS = (
    "alert",
    "module_ranks",
    "append_output",
    "dynamic_on",
    "print_struct",
    "format",
    "tensorboard_layout",
    "category_ops",
    "ndigits",
    "step_count_per_record",
    "tracker",
    "start_step",
    "collect_times",
)
# rules whose alerts exist only once the optimizer step ran (a skip is decided before it)
AFTER_THE_STEP = ("AnomalyRankOutlier", "NanOrigin", "ReplicaMismatch")

ExpectInt = Callable[[str, Any, int], int]


def parse_actions(value: Any, expect_int: ExpectInt) -> list[ActionConfig]:
    """The list under `alert.actions`; `expect_int(where, value, minimum)`: parsing.py's integer check."""
    if not isinstance(value, list):
        raise ConfigError(
            f'alert.actions: expected a list like [{{"on": ["AnomalyNan"], "do": "stop"}}], got {short_repr(value)}'
        )
    return [_parse_action(item, f"alert.actions[{i}]", expect_int) for i, item in enumerate(value)]


def _parse_action(item: Any, where: str, expect_int: ExpectInt) -> ActionConfig:
    if not isinstance(item, dict):
        raise ConfigError(
            f'{where}: expected an object like {{"on": ["AnomalyNan"], "do": "stop"}}, got {short_repr(item)}'
        )
    do = item.get("do")
    if do is None:
        raise ConfigError(f"{where}: no 'do'; expected one of {list(ACTIONS)}")
    if do not in ACTIONS:
        raise ConfigError(
            f"{where}.do: unknown action {short_repr(do)}; expected one of {list(ACTIONS)}{did_you_mean(do, ACTIONS)}"
        )
    valid = COMMON_KEYS + KEYS_OF[do]
    for key in item:
        if key not in valid:
            other = next((d for d, keys in KEYS_OF.items() if key in keys), None)
            hint = f" (a key of {other!r})" if other else did_you_mean(key, valid)
            raise ConfigError(f"{where}: unknown key {short_repr(key)} for {do!r}{hint}; expected {list(valid)}")
    action = ActionConfig(do=do, on=_parse_on(item.get("on"), f"{where}.on"), raw=copy.deepcopy(item))
    if do == "escalate":
        if "for_steps" not in item:
            raise ConfigError(f"{where}: escalate needs 'for_steps' (how many steps the escalated config is in force)")
        action.for_steps = expect_int(f"{where}.for_steps", item["for_steps"], 1)
        overlay = item.get("config")
        if not isinstance(overlay, dict) or not overlay:
            raise ConfigError(
                f'{where}.config: expected the keys to record on top of the base config, like {{"all_xy": true}}, '
                f"got {short_repr(overlay)}"
            )
        fixed = [k for k in overlay if k in FIXED_KEYS]
        if fixed:
            raise ConfigError(
                f"{where}.config: {fixed[0]!r} cannot change during a run (an escalation changes what is recorded, "
                f"not who records it nor how it is written); fixed keys: {', '.join(FIXED_KEYS)}"
            )
        action.config = copy.deepcopy(overlay)
    elif do == "skip_step":
        action.max_per_run = expect_int(f"{where}.max_per_run", item.get("max_per_run", 10), 1)
    elif do == "stop":
        action.repeat_limit = expect_int(f"{where}.repeat_limit", item.get("repeat_limit", 2), 1)
    else:
        _parse_notify(item, where, action, expect_int)
    return action


def _parse_on(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ConfigError(
            f'{where}: expected a list of rule names and verdicts, like ["AnomalyNan", "verdict:one_rank_model_copy"], '
            f"got {short_repr(value)}"
        )
    for name in value:
        if name.startswith(VERDICT_PREFIX):
            code = name[len(VERDICT_PREFIX) :]
            if code not in VERDICT_CODES:
                raise ConfigError(
                    f"{where}: unknown verdict {short_repr(code)}; expected one of "
                    f"{[VERDICT_PREFIX + c for c in VERDICT_CODES]}{did_you_mean(code, VERDICT_CODES)}"
                )
        elif name not in ACTION_RULES:
            close = did_you_mean(name, ACTION_RULES) or did_you_mean(name, [VERDICT_PREFIX + c for c in VERDICT_CODES])
            raise ConfigError(
                f"{where}: unknown rule {short_repr(name)}{close}; expected rule names {list(ACTION_RULES)} or "
                f"'{VERDICT_PREFIX}<code>' with a code of {list(VERDICT_CODES)}"
            )
    return list(dict.fromkeys(value))


def _parse_notify(item: dict, where: str, action: ActionConfig, expect_int: ExpectInt) -> None:
    url, command = item.get("url"), item.get("command")
    if (url is None) == (command is None):
        raise ConfigError(f"{where}: notify needs exactly one of 'url' (POST a JSON message) or 'command' (run it)")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.url: expected an http:// or https:// address, got {short_repr(url)}")
        action.url = url
    else:
        if isinstance(command, str):
            command = [command]
        if not isinstance(command, list) or not command or not all(isinstance(c, str) and c for c in command):
            raise ConfigError(
                f'{where}.command: expected a program and its arguments, like ["notify.sh", "--to", "ops"], '
                f"got {short_repr(command)}"
            )
        action.command = list(command)
    timeout = item.get("timeout", 5.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ConfigError(f"{where}.timeout: expected a positive number of seconds, got {short_repr(timeout)}")
    action.timeout = float(timeout)
    action.retries = expect_int(f"{where}.retries", item.get("retries", 2), 0)


def check_actions(cfg: MonitorConfig, parse: Callable[[Mapping[str, Any]], MonitorConfig]) -> None:
    """What an action needs from the rest of the config: its rules configured, a skip decided
    from rules known before the optimizer step, an escalated config that is a valid config.
    `parse`: parsing.py's parse_config (this module sits beside it)."""
    configured = {rule.rule_name for rule in cfg.alert.rules}
    for i, action in enumerate(cfg.alert.actions):
        where = f"alert.actions[{i}].on"
        for rule in action.rules:
            if rule in ALERT_RULES and rule not in configured:
                raise ConfigError(f"{where}: {rule!r} is not in alert.rules, so it never alerts; add it there")
            if rule == "NanOrigin" and not cfg.nan_origin_enabled:
                raise ConfigError(f"{where}: 'NanOrigin' needs nan_origin (on by default once alert.rules is set)")
            if rule == "ReplicaMismatch" and not cfg.replica_check.enable:
                raise ConfigError(f"{where}: 'ReplicaMismatch' needs replica_check.enable")
            if action.do == "skip_step" and rule in AFTER_THE_STEP:
                raise ConfigError(
                    f"{where}: skip_step is decided before the optimizer step, from the step's own rows; {rule!r} "
                    "is known only after it (use it with escalate, stop or notify)"
                )
        if action.do == "escalate":
            try:
                escalated(cfg, action.config, parse)
            except ConfigError as exc:
                raise ConfigError(f"alert.actions[{i}].config: {exc}") from None


def escalated(
    base: MonitorConfig, overlay: Mapping[str, Any], parse: Callable[[Mapping[str, Any]], MonitorConfig]
) -> MonitorConfig:
    """The base config with an escalation's keys on top (objects merged key by key, so
    `{"replica_check": {"every": 1}}` keeps the base's other replica_check keys); the alert
    section, which an escalation never changes, is the base's own object."""
    merged = _merge({k: v for k, v in resolved(base).items() if k != "alert"}, overlay)
    out = parse(merged)
    out.alert = base.alert
    out.raw = base.raw
    return out


def _merge(base: dict[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and key != "targets":
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out

"""The config in force as a plain mapping: every key with its effective value, the form written
to each rank directory's config.json. Parsing it again gives the same config, so a run's
config.json is what to pass to `--config` to run it again."""

from __future__ import annotations

import dataclasses
from typing import Any

from .schema import AlertConfig, CCConfig, MonitorConfig, ReplicaCheckConfig, keys_of


def resolved(config: MonitorConfig) -> dict[str, Any]:
    """Every key of `config`, in declaration order, with the value in force; a key whose default
    is decided from others (nan_origin) carries the decision."""
    out: dict[str, Any] = {}
    for name in keys_of(MonitorConfig):
        value = getattr(config, name)
        if name == "targets":
            value = {module: {slot: spec.text for slot, spec in slots.items()} for module, slots in value.items()}
        elif name == "nan_origin":
            value = config.nan_origin_enabled
        elif isinstance(value, AlertConfig):
            value = {
                "rules": [
                    {"rule_name": rule.rule_name, **({"args": {"threshold": rule.threshold}} if rule.threshold else {})}
                    for rule in value.rules
                ],
                **{key: getattr(value, key) for key in keys_of(AlertConfig) if key not in ("rules", "actions")},
                "actions": [action.raw for action in value.actions],
            }
        elif isinstance(value, (CCConfig, ReplicaCheckConfig)):
            value = {key: getattr(value, key) for key in keys_of(type(value))}
        elif dataclasses.is_dataclass(value):  # a new nested key: its fields as they are
            value = dataclasses.asdict(value)  # type: ignore[arg-type]
        out[name] = _copy(value)
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value

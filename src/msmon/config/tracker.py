"""The `tracker` key: what the wandb and mlflow formats send (schema.py's TrackerConfig)."""

from __future__ import annotations

from typing import Any

from ..system.short_repr import short_repr
from .errors import ConfigError, did_you_mean
from .schema import TrackerConfig, keys_of


def parse_tracker(value: Any, expect_int: Any) -> TrackerConfig:
    """`expect_int(where, value, minimum)`: parsing.py's integer check (`1e3` is an integer too)."""
    if not isinstance(value, dict):
        raise ConfigError(
            f'tracker: expected an object like {{"project": "msmon", "max_keys": 1000}}, got {short_repr(value)}'
        )
    tracker = TrackerConfig()
    for key, item in value.items():
        where = f"tracker.{key}"
        if key in ("project", "run_name"):
            if item is not None and (not isinstance(item, str) or not item.strip()):
                raise ConfigError(f"{where}: expected a name (a non-empty string) or null, got {short_repr(item)}")
            setattr(tracker, key, item)
        elif key == "max_keys":
            tracker.max_keys = expect_int(where, item, 1)
        elif key == "tensors":
            if isinstance(item, str):
                item = [item]
            if not isinstance(item, list) or not all(isinstance(p, str) and p for p in item):
                raise ConfigError(
                    f'{where}: expected a list of "category/name" patterns like "grad_reduced/*fc1*", '
                    f"got {short_repr(item)}"
                )
            tracker.tensors = list(dict.fromkeys(item))
        else:
            raise ConfigError(
                f"tracker: unknown key {short_repr(key)}{did_you_mean(key, keys_of(TrackerConfig))}; "
                f"expected {list(keys_of(TrackerConfig))}"
            )
    return tracker

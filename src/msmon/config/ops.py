"""The statistics a config asks for: `ops`, and `category_ops`, the ops a category's rows keep.

The names are the op table's (stats/ops.py, torch-free): the one place the config reads from a
layer above it, so that an unknown op is refused before training (.importlinter names it).
"""

from __future__ import annotations

from typing import Any

from ..stats.ops import OPS
from ..system.short_repr import short_repr
from .errors import ConfigError, did_you_mean
from .schema import STATISTIC_CATEGORIES


def parse_ops(value: Any, where: str = "ops") -> list[str]:
    """An ops list (the config's `ops`, a category's, or `monitor.ops = [...]` at run time):
    known names, each once, at least one."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of names from {list(OPS)}, got {short_repr(value)}")
    ops: list[str] = []
    for op in value:
        if op not in OPS:
            raise ConfigError(f"{where}: unknown op {short_repr(op)}; valid ops are {list(OPS)}{did_you_mean(op, OPS)}")
        if op not in ops:
            ops.append(op)
    if not ops:
        raise ConfigError(f"{where}: expected at least one op from {list(OPS)}, got an empty list")
    return ops


def parse_category_ops(value: Any) -> dict[str, list[str]]:
    """{category: [ops]}: known categories, valid ops lists (`check_category_ops` holds them to `ops`)."""
    if not isinstance(value, dict):
        raise ConfigError(
            f"category_ops: expected an object {{category: [ops]}} with categories from {list(STATISTIC_CATEGORIES)}, "
            f"got {short_repr(value)}"
        )
    out: dict[str, list[str]] = {}
    for category, ops in value.items():
        if category not in STATISTIC_CATEGORIES:
            raise ConfigError(
                f"category_ops: unknown category {short_repr(category)}; expected {list(STATISTIC_CATEGORIES)}"
                + did_you_mean(category, STATISTIC_CATEGORIES)
            )
        out[category] = parse_ops(ops, f"category_ops.{category}")
    return out


def check_category_ops(category_ops: dict[str, list[str]], ops: list[str]) -> None:
    """A category keeps some of the statistics computed: each of its ops must be in `ops`."""
    for category, kept in category_ops.items():
        missing = [op for op in kept if op not in ops]
        if missing:
            raise ConfigError(
                f"category_ops.{category}: {short_repr(missing)} not in ops {ops}; a category keeps some of the "
                "statistics `ops` computes: add them to ops"
            )

"""Where statistics go: one file per output format, each registering its Sink class here.

A sink file declares the name the config's `format` gives it with `@sink_format("name")` on its
Sink class; the rank output builds its sinks from this registry, so a new format is one file in
this folder (and its name in the config's list of formats, which the config checks before
training starts without importing the output). The sink files load when sinks are first built:
importing this package loads none of them (nor torch).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Callable, TypeVar

from .base import Sink

if TYPE_CHECKING:
    from ...config import MonitorConfig

__all__ = ["Sink", "sink_format", "registered_formats", "build_sinks"]

_S = TypeVar("_S", bound=type[Sink])
_REGISTRY: dict[str, type[Sink]] = {}


def sink_format(name: str) -> Callable[[_S], _S]:
    """Register a Sink class as the writer of `format: name` (its log lines name it so too)."""

    def register(cls: _S) -> _S:
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"output format {name!r} is registered twice: {_REGISTRY[name]} and {cls}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def registered_formats() -> dict[str, type[Sink]]:
    """{format name: Sink class} of every sink file in this folder."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return dict(_REGISTRY)


def build_sinks(formats: list[str], log_dir: str, config: MonitorConfig) -> list[Sink]:
    """The sinks of the config's `format` (validated by the config), in its order."""
    known = registered_formats()
    return [known[name].for_rank(log_dir, config) for name in formats]

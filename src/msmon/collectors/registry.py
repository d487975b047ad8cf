"""The collector registry: each collector declares itself, the monitor builds what the config enables.

A collector class is registered with `@register(key=..., category=..., order=..., enabled=...)`;
the monitor builds, in ascending `order`, every registered collector whose `enabled(config, ctx)`
holds (those with `module_hooks` only where this monitor hooks the model's modules). The order is
the order rows are written in, so it is part of the output format: keep it when adding one.
Adding a collector is one module here, imported by `collectors/__init__.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from ..config import MonitorConfig
    from ..runtime.step_context import StepContext
    from .base import Collector

Enabled = Callable[["MonitorConfig", "StepContext"], bool]
C = TypeVar("C", bound="type[Collector]")


@dataclass(frozen=True)
class CollectorSpec:
    """How and when one collector is built."""

    key: str  # its name in the registry
    category: str  # what it watches: "module", "param", "optimizer", "comm" or "check"
    order: int  # build (and row) order
    enabled: Enabled  # whether the config (and the model) call for it
    module_hooks: bool  # hooks the model's modules: only built where this monitor hooks them
    factory: Callable[[StepContext], Collector]


_SPECS: dict[str, CollectorSpec] = {}


def register(*, key: str, category: str, order: int, enabled: Enabled, module_hooks: bool = False) -> Callable[[C], C]:
    """Class decorator: declare a collector (built as `cls(ctx)`)."""

    def decorate(cls: C) -> C:
        if key in _SPECS and _SPECS[key].factory is not cls:
            raise ValueError(f"collector key {key!r} is registered twice")
        if any(s.order == order and s.key != key for s in _SPECS.values()):
            raise ValueError(f"collector order {order} of {key!r} is taken")
        _SPECS[key] = CollectorSpec(key, category, order, enabled, module_hooks, cls)
        cls.key = key
        return cls

    return decorate


def specs() -> list[CollectorSpec]:
    """Every registered collector, in build order."""
    return sorted(_SPECS.values(), key=lambda s: s.order)


def build(ctx: StepContext, hook_modules: bool) -> list[Collector]:
    """The collectors `ctx.config` enables, built in order (not attached yet)."""
    built: list[Collector] = []
    for spec in specs():
        if spec.module_hooks and not hook_modules:
            continue
        if spec.enabled(ctx.config, ctx):
            built.append(spec.factory(ctx))
    return built


def find(collectors: list[Collector], key: str) -> Collector | None:
    """The collector registered under `key` among `collectors`, if built."""
    return next((c for c in collectors if getattr(c, "key", None) == key), None)

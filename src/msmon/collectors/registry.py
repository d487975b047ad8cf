"""The collector registry: each collector declares itself, the monitor builds what the config enables.

A collector class is registered with `@register(key=..., category=..., order=..., enabled=...)`;
the monitor builds, in ascending `order`, every registered collector whose `enabled(config, ctx)`
holds (those with `module_hooks` only where this monitor hooks the model's modules). The order is
the order rows are written in, so it is part of the output format: keep it when adding one.
Adding a collector is one module here, imported by `collectors/__init__.py`.

The step itself asks three things of the collectors built (runtime/step.py's `Built`): the
micro-step tracker, how many backward passes the step had, the module tree print_struct writes.
The collector that answers one declares it (`serves=`), and a collector whose config names parts
of the model declares its check (`fits=`), so the api builds and checks them all from here,
never naming one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..runtime.selection import ModuleCheck
from ..runtime.step import Built
from .base import Collector

if TYPE_CHECKING:
    from ..config import MonitorConfig
    from ..runtime.step_context import StepContext

Enabled = Callable[["MonitorConfig", "StepContext"], bool]
C = TypeVar("C", bound="type[Collector]")

# what a collector may serve the step (register's `serves`), one collector each
TRACKS_MICRO_STEPS = "tracks micro-steps"  # StepContext.tracker: forward_micro, backward_micro
COUNTS_BACKWARD = "counts backward passes"  # micro_steps_seen(): grad_acc_steps when not given
WRITES_MODULE_TREE = "writes the module tree"  # print_struct: write, render_tree, then the run stops
SERVICES = (TRACKS_MICRO_STEPS, COUNTS_BACKWARD, WRITES_MODULE_TREE)


@dataclass(frozen=True)
class CollectorSpec:
    """How and when one collector is built."""

    key: str  # its name in the registry
    category: str  # what it watches: "module", "param", "optimizer", "comm" or "check"
    order: int  # build (and row) order
    enabled: Enabled  # whether the config (and the model) call for it
    module_hooks: bool  # hooks the model's modules: only built where this monitor hooks them
    factory: Callable[[StepContext], Collector]
    serves: str | None = None  # one of SERVICES
    fits: ModuleCheck | None = None  # ConfigError unless the config's names for it fit the model


_SPECS: dict[str, CollectorSpec] = {}


def register(
    *,
    key: str,
    category: str,
    order: int,
    enabled: Enabled,
    module_hooks: bool = False,
    serves: str | None = None,
    fits: ModuleCheck | None = None,
) -> Callable[[C], C]:
    """Class decorator: declare a collector (built as `cls(ctx)`)."""

    def decorate(cls: C) -> C:
        if key in _SPECS and _SPECS[key].factory is not cls:
            raise ValueError(f"collector key {key!r} is registered twice")
        if any(s.order == order and s.key != key for s in _SPECS.values()):
            raise ValueError(f"collector order {order} of {key!r} is taken")
        if serves is not None and (
            serves not in SERVICES or any(s.serves == serves and s.key != key for s in _SPECS.values())
        ):
            raise ValueError(f"collector {key!r} cannot serve {serves!r}: one of {SERVICES}, one collector each")
        _SPECS[key] = CollectorSpec(key, category, order, enabled, module_hooks, cls, serves, fits)
        cls.key = key
        return cls

    return decorate


def specs() -> list[CollectorSpec]:
    """Every registered collector, in build order."""
    return sorted(_SPECS.values(), key=lambda s: s.order)


def build(ctx: StepContext, hook_modules: bool) -> Built:
    """The collectors `ctx.config` enables, built in order (not attached yet), and those of them
    that serve the step; the micro-step tracker, when built, becomes `ctx.tracker`."""
    built: list[Collector] = []
    serving: dict[str, Any] = {}
    ctx.tracker = None
    for spec in specs():
        if spec.module_hooks and not hook_modules:
            continue
        if spec.enabled(ctx.config, ctx):
            built.append(spec.factory(ctx))
            if spec.serves is not None:
                serving[spec.serves] = built[-1]
    ctx.tracker = serving.get(TRACKS_MICRO_STEPS)
    counter = serving.get(COUNTS_BACKWARD)
    seen = counter.micro_steps_seen if counter is not None else lambda: 0
    # the step calls only the collectors that do something around the update (no no-op call each)
    phases = {
        phase: [c for c in built if getattr(type(c), phase) is not getattr(Collector, phase)]
        for phase in ("before_update", "after_update")
    }
    return Built(built, seen, serving.get(WRITES_MODULE_TREE), phases)


def target_checks() -> tuple[ModuleCheck, ...]:
    """Every registered collector's check of the config's names against the model (`fits`)."""
    return tuple(spec.fits for spec in specs() if spec.fits is not None)

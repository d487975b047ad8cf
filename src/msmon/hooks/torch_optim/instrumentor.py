"""Attach a TrainerMon to every torch.optim optimizer a script builds, with no code change.

When: at construction, the moment the outermost `__init__` of the optimizer returns. The
model is known by then in almost every script (the optimizer is built from its
parameters), and attaching before the first forward means step 0 is recorded like every
other step: activations, per-micro-batch gradients, the grad_acc_steps inference. Attaching
at the first `step()` instead would miss all of step 0 except the reduced gradients and
the weights, so it is only the fallback: for optimizers built before msmon was loaded, or
whose parameters belonged to no module yet.

How: every Optimizer subclass's own `__init__` is wrapped (the existing classes now, classes
defined later, a user's included, through `Optimizer.__init_subclass__`); a global step
pre-hook is the fallback. Optimizers built inside another optimizer's constructor (sharded
or wrapping optimizers) and wrappers that resolve to an already monitored optimizer
(accelerate's AcceleratedOptimizer, Lookahead-like classes sharing `param_groups`) are not
monitored twice. Copies of an optimizer (`copy.deepcopy`, pickling) are not monitored at all.

Each monitored optimizer gets its own TrainerMon, hence its own output directory. The
monitor and its adapter hold the optimizer through weak references (`TrainerMon.optimizer`
is None once it is gone), so an optimizer the script drops is garbage collected; its monitor
is then closed (pending rows written, summary.json) and released.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

from ...collectors.l2_features.targets import l2_targets_error, l2_targets_nowhere
from ...config import ConfigError
from ...seams.adapter_choice import resolve_optimizer
from ...seams.module_registry import ModuleTracker, roots_in_memory
from ...seams.pipeline import pipeline_position
from ...system.distributed import current_rank
from .. import Session, handover
from ..attach import module_monitor, on_optimizer_collected, start_monitor, targets_error
from ..monitor_factory import AttachedMonitor

logger = logging.getLogger("msmon")

CONSTRUCTION, FIRST_STEP = "construction", "first step"
_WRAPPED_FLAG = "__msmon_wrapped__"

_local = threading.local()  # .building: {id(optimizer): nesting} of constructors running here
_instrumentation: _Instrumentation | None = None


def instrument(session: Session) -> None:
    global _instrumentation
    if _instrumentation is None:
        _instrumentation = _Instrumentation(session)
        _instrumentation.install()
        handover.watch_constructions(_instrumentation)


def uninstrument() -> None:
    global _instrumentation
    if _instrumentation is not None:
        handover.watch_constructions(None)
        _instrumentation.remove()
        _instrumentation = None


def _building() -> dict[int, int]:
    building = getattr(_local, "building", None)
    if building is None:
        building = _local.building = {}
    return building


class _Instrumentation:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.tracker = ModuleTracker()
        self._originals: dict[type, Callable[..., None]] = {}
        self._had_init_subclass = "__init_subclass__" in Optimizer.__dict__
        self._step_hook: Any = None
        self._original_setstate: Callable[..., None] | None = None
        self._decided: dict[int, weakref.ref] = {}  # id(optimizer) -> optimizer: handled once
        self._attached: list[tuple[weakref.ref, AttachedMonitor]] = []  # the monitored optimizers
        self._lock = threading.RLock()

    # -- installing ------------------------------------------------------------------------------
    def install(self) -> None:
        self.tracker.start()
        for cls in _with_subclasses(Optimizer):
            self._wrap_init(cls)
        instrumentation = self

        def __init_subclass__(cls: type[Optimizer], **kwargs: Any) -> None:
            super(Optimizer, cls).__init_subclass__(**kwargs)
            instrumentation._wrap_init(cls)

        Optimizer.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
        self._wrap_setstate()
        self._step_hook = register_optimizer_step_pre_hook(self._on_step)

    def _wrap_setstate(self) -> None:
        """An optimizer made by `copy.deepcopy`, `copy.copy` or unpickling is built by
        `Optimizer.__setstate__` (every subclass's calls it), never by `__init__`: a snapshot
        (an EMA's, a checkpoint's), not the optimizer training runs, so it is never monitored,
        not even at its first step. Its own hooks are torch's: `__getstate__` copies none.
        `load_state_dict` calls `__setstate__` too, on a built optimizer: that one is left as it was."""
        original = Optimizer.__dict__["__setstate__"]
        decide = self._decide

        @functools.wraps(original)
        def __setstate__(opt: Any, state: dict[str, Any]) -> None:
            copied = "param_groups" not in getattr(opt, "__dict__", {})  # an empty object: a copy being made
            original(opt, state)
            if copied:
                decide(opt)

        setattr(__setstate__, _WRAPPED_FLAG, True)
        self._original_setstate = original
        Optimizer.__setstate__ = __setstate__  # type: ignore[method-assign, assignment]

    def remove(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._original_setstate is not None:
            Optimizer.__setstate__ = self._original_setstate  # type: ignore[method-assign]
            self._original_setstate = None
        if not self._had_init_subclass and "__init_subclass__" in Optimizer.__dict__:
            del Optimizer.__init_subclass__
        for cls, original in self._originals.items():
            cls.__init__ = original  # type: ignore[misc]
        self._originals.clear()
        self.tracker.stop()

    def _wrap_init(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, _WRAPPED_FLAG, False):
            return
        on_built = self._on_built

        @functools.wraps(original)
        def __init__(opt: Any, *args: Any, **kwargs: Any) -> None:
            building = _building()
            key = id(opt)
            outermost = key not in building  # not a super().__init__ of the same object
            inside_another = outermost and bool(building)
            building[key] = building.get(key, 0) + 1
            try:
                original(opt, *args, **kwargs)
            finally:
                building[key] -= 1
                if not building[key]:
                    del building[key]
            if outermost:
                on_built(opt, inside_another)

        setattr(__init__, _WRAPPED_FLAG, True)
        self._originals[cls] = original
        cls.__init__ = __init__  # type: ignore[misc]

    # -- deciding ----------------------------------------------------------------------------------
    def _on_built(self, opt: Any, inside_another: bool) -> None:
        if not self.session.may_attach():
            return
        if inside_another or handover.suppression_depth():
            self._decide(opt)  # another optimizer's part, or a framework's own: never ours
            return
        self._guarded(opt, CONSTRUCTION)

    def _on_step(self, opt: Any, _args: tuple, _kwargs: dict) -> None:
        if not self._is_decided(opt) and self.session.may_attach() and not handover.suppression_depth():
            self._guarded(opt, FIRST_STEP)
        return None

    def _guarded(self, opt: Any, when: str) -> None:
        try:
            with self._lock:
                self._consider(opt, when)
        except Exception as exc:  # monitoring must never break the training script
            self._decide(opt)
            logger.error(
                "msmon[rank %d]: attaching to %s failed; it is not monitored: %r",
                current_rank(),
                type(opt).__name__,
                exc,
            )
            self.session.emit("skipped", optimizer=type(opt).__name__, reason=f"attaching failed: {exc!r}")

    def _is_decided(self, opt: Any) -> bool:
        known = self._decided.get(id(opt))
        return known is not None and known() is opt

    def claim(self, opt: Any) -> None:
        """Never attach to `opt`: a framework's monitor covers it (handover.claim)."""
        self._decide(opt)

    def _decide(self, opt: Any) -> None:
        key = id(opt)
        decided = self._decided

        def forget(ref: weakref.ref, key: int = key) -> None:
            if decided.get(key) is ref:
                del decided[key]

        decided[key] = weakref.ref(opt, forget)

    def _consider(self, opt: Any, when: str) -> None:
        if self._is_decided(opt):
            return
        real = resolve_optimizer(opt)
        if real is not opt or self._wraps_monitored(opt):
            self._decide(opt)  # a wrapper: the optimizer inside is the one to monitor
            if real is not opt:
                self._consider(real, when)
            return
        params = [p for group in getattr(opt, "param_groups", None) or [] for p in group.get("params", [])]
        if not params:
            self._defer(opt, when, "it had no parameters when it was built")
            return  # nothing to monitor yet; its first step looks again
        ids = {id(p) for p in params}
        roots = self.tracker.roots_owning(ids)
        if not roots and when == CONSTRUCTION:
            self._defer(opt, when, "its parameters belonged to no module when it was built")
            return  # its model is unknown so far; its first step looks again
        if not roots:
            roots = roots_in_memory(ids)
        self._decide(opt)
        if not roots:
            self._skip(opt, "its parameters belong to no nn.Module")
            return
        self._attach(opt, roots, when)

    def _targets_elsewhere(self, opt: Any, roots: list[torch.nn.Module], error: ConfigError) -> None:
        """This optimizer's model lacks a target: leave it alone when another model built so far
        has every missing one (a GAN's other optimizer); else the target names no module at all,
        a config mistake that stops the job before training, as the API's set_monitor does. On
        one stage of a pipeline the other stages may hold it, so it is only left alone there."""
        config = self.session.config
        others = [[m] for m in _models_built(self.tracker) if all(m is not r for r in roots)]
        nowhere = [
            t
            for t in config.targets
            if all(targets_error([t], chunks, config.squash_name) is not None for chunks in [roots, *others])
        ]
        if nowhere and len(pipeline_position()[1]) == 1:
            reason = str(targets_error(nowhere[:1], roots, config.squash_name))
            if others:
                reason += f" (nor of the {len(others)} other model{'s' if len(others) > 1 else ''} this process built)"
            self.session.stop(reason)
        self._skip(opt, f"the config's targets are not in its model ({error})")

    def _wraps_monitored(self, opt: Any) -> bool:
        """Lookahead-like wrappers share the inner optimizer's `param_groups` list."""
        groups = getattr(opt, "param_groups", None)
        return groups is not None and any(
            inner is not None and inner is not opt and getattr(inner, "param_groups", None) is groups
            for inner in (ref() for ref, _ in self._attached)
        )

    def release(self, opt: Any) -> bool:
        with self._lock:
            for ref, monitor in self._attached:
                if ref() is opt:
                    self._attached.remove((ref, monitor))
                    on_optimizer_collected(self.session, monitor)
                    return True
        return False

    def _defer(self, opt: Any, when: str, reason: str) -> None:
        """Left for its first step: said at exit if that step never comes (worker.Unmonitored)."""
        if when == CONSTRUCTION:
            self.session.emit("deferred", optimizer=type(opt).__name__, reason=reason)

    def _skip(self, opt: Any, reason: str) -> None:
        logger.info("msmon[rank %d]: %s is not monitored: %s", current_rank(), type(opt).__name__, reason)
        self.session.emit("skipped", optimizer=type(opt).__name__, reason=reason)

    # -- attaching ---------------------------------------------------------------------------------
    def _attach(self, opt: Any, roots: list[torch.nn.Module], when: str) -> None:
        config = self.session.config
        if config.targets:
            error = targets_error(config.targets, roots, config.squash_name)
            if error is not None:
                self._targets_elsewhere(opt, roots, error)
                return
        error = l2_targets_error(config, roots)
        if error is not None:  # as for targets: another model may hold them, else a mistake that stops
            others = [m for m in _models_built(self.tracker) if all(m is not r for r in roots)]
            nowhere = l2_targets_nowhere(config, roots, others)
            if nowhere is not None and len(pipeline_position()[1]) == 1:
                self.session.stop(str(nowhere))
            self._skip(opt, f"the config's l2_targets are not in its model ({error})")
            return
        monitor = start_monitor(
            self.session,
            roots[0] if len(roots) == 1 else roots,
            opt,
            when,
            [type(root).__name__ for root in roots],
            shares_modules_with=module_monitor(self.session, roots),
        )
        self._attached = [(ref, m) for ref, m in self._attached if ref() is not None] + [(weakref.ref(opt), monitor)]


def _models_built(tracker: ModuleTracker) -> list[torch.nn.Module]:
    """The models the process built so far: tracked modules with parameters that are nobody's child."""
    modules = tracker.modules()
    children = {id(child) for m in modules for child in m._modules.values() if child is not None}
    return [m for m in modules if id(m) not in children and next(m.parameters(), None) is not None]


def _with_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        current = todo.pop()
        if current not in out:
            out.append(current)
            todo.extend(current.__subclasses__())
    return out

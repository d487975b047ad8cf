"""An optimizer a framework built (DeepSpeed, Megatron, accelerate's `prepare`): its
instrumentor hands over the model chunks and the optimizer, gets one monitor through the one
attach sequence (attach.py), and tells the torch.optim instrumentor to leave every optimizer
inside it alone.

The framework packages never import one another, the torch.optim one included: the instrumentor
that attaches at every optimizer's construction registers itself here while it is switched on
(`watch_constructions`), and a framework tells it through this module what to leave alone
(`suppressed()` around the optimizers it builds, `release` of one it takes over, `claim`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ..config import ConfigError
from ..runtime.naming import model_chunks
from ..seams.module_attrs import stored
from ..seams.pipeline import pipeline_position
from ..system.distributed import current_rank
from . import Session
from .attach import start_monitor, targets_error
from .monitor_factory import AttachedMonitor

logger = logging.getLogger("msmon")

_attached: weakref.WeakSet[Any] = weakref.WeakSet()  # framework optimizers with a monitor
_local = threading.local()  # .suppressed: how many `suppressed()` blocks this thread is inside


class ConstructionWatcher(Protocol):
    """The instrumentor that attaches at every optimizer's construction (hooks/torch_optim)."""

    def release(self, optimizer: Any) -> bool:
        """Close and forget the monitor it attached to `optimizer`; whether there was one."""

    def claim(self, optimizer: Any) -> None:
        """Never attach to `optimizer`: a framework's monitor covers it."""


_watcher: ConstructionWatcher | None = None


def watch_constructions(watcher: ConstructionWatcher | None) -> None:
    """Register the construction-time instrumentor (None when it switches off)."""
    global _watcher
    _watcher = watcher


def release(optimizer: Any) -> bool:
    """Close and forget the monitor attached to `optimizer` at its construction: for framework
    instrumentors that take over an optimizer the script built first
    (`deepspeed.initialize(optimizer=...)`). Returns whether there was one."""
    return _watcher is not None and _watcher.release(optimizer)


def suppression_depth() -> int:
    """How many `suppressed()` blocks this thread is inside (0: none)."""
    return getattr(_local, "suppressed", 0)


@contextmanager
def suppressed() -> Iterator[None]:
    """Optimizers built inside this block are left alone: for framework instrumentors
    (DeepSpeed, Megatron) that attach to the optimizers they build themselves."""
    _local.suppressed = suppression_depth() + 1
    try:
        yield
    finally:
        _local.suppressed -= 1


def is_attached(optimizer: Any) -> bool:
    try:
        return optimizer in _attached
    except TypeError:
        return False


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The optimizer and every optimizer it drives (`.optimizer`, chained ones), outermost first."""
    out: list[Any] = []
    todo = [optimizer]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is seen for seen in out):
            continue
        out.append(current)
        todo.extend(getattr(current, "chained_optimizers", None) or [])
        try:  # Megatron's ChainedOptimizer asserts it holds one optimizer when asked for `.optimizer`
            todo.append(getattr(current, "optimizer", None))
        except Exception:
            pass
    return out


def claim(optimizer: Any) -> None:
    """Keep the torch.optim instrumentor off this optimizer and the ones inside it: the
    framework's monitor covers them (a second monitor would see flat fp32 partitions)."""
    watcher = _watcher
    if watcher is None:
        return
    for opt in inner_optimizers(optimizer):
        watcher.release(opt)
        watcher.claim(opt)


def attach(session: Session, models: Any, optimizer: Any, when: str) -> AttachedMonitor | None:
    """A monitor on the optimizer a framework built, with `models` (a module or the list of
    virtual-pipeline chunks); None when it cannot be attached (reported, training goes on)."""
    from ..collectors.l2_features.targets import l2_targets_error

    if optimizer is None or is_attached(optimizer) or not session.may_attach():
        return None
    claim(optimizer)
    chunks_given = models if isinstance(models, (list, tuple)) else [models]
    names = [type(stored(m, "module", m)).__name__ for m in chunks_given]
    try:
        monitor = start_monitor(session, models, optimizer, when, names)
    except ConfigError as exc:
        config = session.config
        chunks = model_chunks(models)  # on one pipeline stage, another may hold the target
        if (
            targets_error(config.targets, chunks, config.squash_name) is not None
            or l2_targets_error(config, chunks) is not None
        ) and len(pipeline_position()[1]) == 1:
            session.stop(str(exc))
        logger.error("msmon[rank %d]: %s is not monitored: %s", current_rank(), type(optimizer).__name__, exc)
        session.emit("skipped", optimizer=type(optimizer).__name__, reason=str(exc))
        return None
    _attached.add(optimizer)
    return monitor

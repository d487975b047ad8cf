"""Attaching a monitor to an optimizer a framework built (DeepSpeed, Megatron), shared by their
instrumentors: the framework hands over the model chunks and the optimizer, the torch.optim
instrumentor is told to leave every optimizer inside it alone, and the launcher hears about it.
Like the torch.optim instrumentor's, the monitor holds the optimizer weakly and is closed and
released once the optimizer is garbage-collected.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from ..collectors.l2_features import l2_targets_error
from ..config import ConfigError
from ..distributed import current_rank, pipeline_position
from ..naming import model_chunks
from . import Session, torch_optim

logger = logging.getLogger("msmon")

_attached: weakref.WeakSet[Any] = weakref.WeakSet()  # framework optimizers with a monitor


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
    for opt in inner_optimizers(optimizer):
        torch_optim.release(opt)
        torch_optim.claim(opt)


def attach(session: Session, models: Any, optimizer: Any, when: str) -> Any:
    """A TrainerMon on `optimizer` with `models` (a module or the list of virtual-pipeline
    chunks); None when it cannot be attached (reported, training goes on)."""
    from ..monitor import TrainerMon

    if optimizer is None or is_attached(optimizer) or not session.in_owner_process():
        return None
    claim(optimizer)
    monitor = TrainerMon(session.config_path)
    try:
        monitor.set_monitor(models, optimizer)
    except ConfigError as exc:
        monitor.close()
        config = session.config
        chunks = model_chunks(models)  # on one pipeline stage, another may hold the target
        if (
            torch_optim.targets_error(config.targets, chunks, config.squash_name) is not None
            or l2_targets_error(config, chunks) is not None
        ) and len(pipeline_position()[1]) == 1:
            session.stop(str(exc))
        logger.error("msmon[rank %d]: %s is not monitored: %s", current_rank(), type(optimizer).__name__, exc)
        session.emit("skipped", optimizer=type(optimizer).__name__, reason=str(exc))
        return None
    except BaseException:
        monitor.close()
        raise
    _attached.add(optimizer)
    session.monitors.append(monitor)
    torch_optim.close_when_collected(optimizer, session, monitor)
    chunks = models if isinstance(models, (list, tuple)) else [models]
    names = [type(getattr(m, "module", m)).__name__ for m in chunks]
    logger.info(
        "msmon[rank %d]: monitoring %s of %s (attached at %s) -> %s",
        current_rank(),
        type(optimizer).__name__,
        " + ".join(names),
        when,
        monitor.log_dir or "no output on this rank",
    )
    session.emit("attached", monitor=monitor, optimizer=type(optimizer).__name__, models=names, when=when)
    return monitor

"""The one attach sequence: a TrainerMon built on an optimizer and its model, registered with the
session, closed and released once the optimizer is garbage-collected, and announced (log line,
"attached" event). The torch.optim instrumentor uses it for the optimizers a script builds;
`attach` below for the optimizer a framework built (DeepSpeed, Megatron), whose instrumentors
hand over the model chunks and the optimizer, and tell the torch.optim instrumentor to leave
every optimizer inside it alone.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ..config import ConfigError
from ..module_attrs import stored
from ..naming import check_targets, display, model_chunks
from ..system.distributed import current_rank
from . import Session, explicit, torch_optim
from .pipeline import pipeline_position

if TYPE_CHECKING:
    from ..monitor import TrainerMon

logger = logging.getLogger("msmon")

_attached: weakref.WeakSet[Any] = weakref.WeakSet()  # framework optimizers with a monitor


def start_monitor(
    session: Session, models: Any, optimizer: Any, when: str, names: list[str], shares_modules_with: Any = None
) -> TrainerMon:
    """A TrainerMon on `optimizer` with `models` (a module or a list of chunks), `names` their
    class names for the log. `shares_modules_with`: the monitor that already hooks these
    models' modules (their activations are then recorded once, by it). A failing set_monitor
    closes the monitor and raises (ConfigError for a config that does not fit the model)."""
    from ..monitor import TrainerMon

    with explicit.automatic():
        monitor = TrainerMon(session.config_path)
    monitor.records_modules = shares_modules_with is None
    try:
        monitor.set_monitor(models, optimizer)
    except BaseException:
        monitor.close()
        raise
    session.monitors.append(monitor)
    close_when_collected(optimizer, session, monitor)
    shared = (
        ""
        if shares_modules_with is None
        else (
            f"; its model's activations are recorded once, by the monitor of "
            f"{shares_modules_with.adapter.optimizer_name} ({shares_modules_with.log_dir})"
        )
    )
    logger.info(
        "msmon[rank %d]: monitoring %s of %s (attached at %s) -> %s%s",
        current_rank(),
        type(optimizer).__name__,
        " + ".join(names),
        when,
        monitor.log_dir or "no output on this rank",
        shared,
    )
    session.emit("attached", monitor=monitor, optimizer=type(optimizer).__name__, models=names, when=when)
    return monitor


# -- an optimizer a framework built ----------------------------------------------------------------
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


def attach(session: Session, models: Any, optimizer: Any, when: str) -> TrainerMon | None:
    """A TrainerMon on the optimizer a framework built, with `models` (a module or the list of
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


def targets_error(targets: Any, chunks: list[torch.nn.Module], squash: bool) -> ConfigError | None:
    """Why `targets` are not all in the model made of `chunks` (None: they are)."""
    try:
        check_targets(
            targets,
            [{display(n, squash) for n, _ in chunk.named_modules()} for chunk in chunks],
            [{display(n, squash) for n, _ in chunk.named_parameters()} for chunk in chunks],
        )
    except ConfigError as exc:
        return exc
    return None


# -- when the optimizer goes -----------------------------------------------------------------------
def close_when_collected(optimizer: Any, session: Session, monitor: TrainerMon) -> None:
    """Once the script drops `optimizer`, close its monitor and release it."""
    weakref.finalize(optimizer, on_optimizer_collected, session, monitor)


def on_optimizer_collected(session: Session, monitor: TrainerMon) -> None:
    """The script dropped the optimizer: write what is pending and let the monitor go."""
    if threading.current_thread().name.startswith("msmon-writer"):
        threading.Thread(target=on_optimizer_collected, args=(session, monitor), daemon=False).start()
        return
    try:
        monitor.close()
    except Exception as exc:
        logger.warning("msmon[rank %d]: closing the monitor of a collected optimizer failed: %r", monitor.rank, exc)
    if monitor in session.monitors:
        session.monitors.remove(monitor)
        try:
            _hand_modules_over(session, monitor)
        except Exception as exc:
            logger.warning(
                "msmon[rank %d]: handing the model's activations over to another monitor failed: %r", monitor.rank, exc
            )
    session.emit("closed", monitor=monitor)


def module_monitor(session: Session, roots: list[torch.nn.Module]) -> TrainerMon | None:
    """The live monitor that already hooks the modules of all of `roots` (two optimizers over
    parts of one model: its activations are recorded once), or None."""
    for monitor in session.monitors:
        if monitor.records_modules and all(any(root is m for m in monitor.models) for root in roots):
            return monitor
    return None


def _hand_modules_over(session: Session, gone: TrainerMon) -> None:
    """`gone` hooked its models' modules for the other optimizers over them too: the first of
    those still monitored takes the modules over from its next forward."""
    if not gone.records_modules:
        return
    for monitor in session.monitors:
        if (
            monitor is not gone
            and not monitor.records_modules
            and any(m is g for m in monitor.models for g in gone.models)
        ):
            monitor.records_modules = True
            if monitor.attached and monitor.active:
                monitor._rebuild_collectors()
            return

"""The one attach sequence: a monitor (the session's factory builds it: the api's TrainerMon) on an
optimizer and its model, registered with the session, closed and released once the optimizer is
garbage-collected, and announced (log line, "attached" event). The torch.optim instrumentor uses
it for the optimizers a script builds; hooks/handover.py for the optimizer a framework built
(DeepSpeed, Megatron, accelerate).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

import torch

from ..config import ConfigError
from ..runtime.naming import display
from ..runtime.selection import check_names as check_targets
from ..system.distributed import current_rank
from ..system.environment import ENV_JOB_MODE
from . import Session, automatic
from .monitor_factory import AttachedMonitor

logger = logging.getLogger("msmon")


def start_monitor(
    session: Session, models: Any, optimizer: Any, when: str, names: list[str], shares_modules_with: Any = None
) -> AttachedMonitor:
    """A monitor on `optimizer` with `models` (a module or a list of chunks), `names` their
    class names for the log. `shares_modules_with`: the monitor that already hooks these
    models' modules (their activations are then recorded once, by it). A failing set_monitor
    closes the monitor and raises (ConfigError for a config that does not fit the model)."""
    with automatic.building():
        monitor = session.build_monitor(session.config_path)
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
    if os.environ.get(ENV_JOB_MODE) == "struct":  # its output is a scratch the launcher moves the tree out of
        logger.info(
            "msmon[rank %d]: reading the module structure of %s (attached at %s)",
            current_rank(),
            " + ".join(names),
            when,
        )
    else:
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
def close_when_collected(optimizer: Any, session: Session, monitor: AttachedMonitor) -> None:
    """Once the script drops `optimizer`, close its monitor and release it."""
    weakref.finalize(optimizer, on_optimizer_collected, session, monitor)


def on_optimizer_collected(session: Session, monitor: AttachedMonitor) -> None:
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


def module_monitor(session: Session, roots: list[torch.nn.Module]) -> AttachedMonitor | None:
    """The live monitor that already hooks the modules of all of `roots` (two optimizers over
    parts of one model: its activations are recorded once), or None."""
    for monitor in session.monitors:
        if monitor.records_modules and all(any(root is m for m in monitor.models) for root in roots):
            return monitor
    return None


def _hand_modules_over(session: Session, gone: AttachedMonitor) -> None:
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
            monitor.rebuild_collectors()  # a no-op before set_monitor or on a rank that records nothing
            return

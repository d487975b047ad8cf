"""A script that builds its own TrainerMon under `msmon run` (or `import msmon.auto`) monitors
itself: the explicit monitor wins and the automatic one stands down.

Without this, such a script is monitored twice: two rank directories, every statistic
computed twice. The moment the script constructs a TrainerMon, the session stops attaching
(`Session.may_attach` is false from then on) and the monitors it attached so far are closed.
An automatic monitor that recorded nothing yet leaves nothing behind (its fresh directory
goes); one that recorded steps keeps them, since nothing already written is ever lost.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from ..system import lifecycle
from . import Session, automatic
from .attach import on_optimizer_collected
from .monitor_factory import AttachedMonitor

logger = logging.getLogger("msmon")


def watch(session: Session) -> None:
    """Stand `session` down when the script builds a TrainerMon of its own."""
    lifecycle.on_register(lambda monitor: _on_new_monitor(session, monitor))


def _on_new_monitor(session: Session, monitor: Any) -> None:
    if automatic.being_built() or session.stood_down or not session.in_owner_process():
        return
    session.stood_down = True
    withdrawn = list(session.monitors)
    for automatic_monitor in withdrawn:
        try:
            withdraw(session, automatic_monitor)
        except Exception as exc:  # the script's monitor goes on either way
            logger.warning("msmon[rank %d]: standing the automatic monitor down failed: %r", monitor.rank, exc)
    logger.info(
        "msmon[rank %d]: the script builds its own TrainerMon; msmon's automatic monitoring stands down%s",
        monitor.rank,
        f" ({len(withdrawn)} automatic monitor{'s' if len(withdrawn) > 1 else ''} closed)" if withdrawn else "",
    )
    session.emit("explicit", monitor=monitor)


def withdraw(session: Session, monitor: AttachedMonitor) -> None:
    """Close an automatic monitor; remove its directory if it recorded nothing there."""
    on_optimizer_collected(session, monitor)  # detach, write what is pending, forget it
    log_dir = monitor.log_dir
    if monitor.steps_recorded == 0 and monitor.output.resume is None and log_dir and os.path.isdir(log_dir):
        shutil.rmtree(log_dir, ignore_errors=True)
    session.emit("withdrawn", log_dir=log_dir)

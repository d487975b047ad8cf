"""Instrumentors: one package per instrumented library, each attaching msmon to code that never
mentions it, and holding everything msmon knows about that library.

A package `hooks/<name>/` exports, in its light `__init__.py` (it never imports its library;
heavy parts are imported when first used), one typed `Framework` as `FRAMEWORK`
(seams/spec.py): how to switch it on and off, the versions it supports, and, where the
library has them, the adapter of its optimizers, its optimizer classes, msprobe's opt_ty names,
its parallel groups, its pipeline position, the replica check's exceptions, the import that
switches it on and its place in the order frameworks are asked. The registry
(seams/registry.py) finds the packages in this folder and puts them in that order.

`enable(session)` registers a post-import hook (wrapt) on the module each spec names, so an
instrumentor is switched on only when the training script imports its library, right away if
it already did. One that fails (to import, to export a Framework, to switch on) is reported once
and the others go on.

To add a framework: write the folder `hooks/<name>/`; nothing else names it.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

from ..config import MonitorConfig, load_config
from ..seams import registry
from ..seams.spec import Framework
from ..seams.versions import warn_if_unsupported
from ..system.distributed import current_rank
from ..system.exit_codes import CONFIG_ERROR
from .monitor_factory import AttachedMonitor, MonitorFactory

logger = logging.getLogger("msmon")

Listener = Callable[[str, dict], None]


class StopBeforeTraining(SystemExit):
    """A config mistake seen only once the model is known (a target that names no module):
    bad input, not a monitoring failure, so the process stops before training instead of
    training unmonitored. A SystemExit: no traceback, and the script's `except Exception`
    cannot swallow it."""


@dataclass
class Session:
    """What the instrumentors of one process share: the config every monitor is built from,
    the factory that builds them (given by the layer above: the hooks never import the api),
    the monitors attached so far, and who wants to hear about attachments (the launcher's
    worker record). Created in every process of a job that imports torch; whether the process
    is a training rank is decided when it builds an optimizer (or a framework hands one over):
    hooks ask `may_attach()` first. Forked children inherit it in memory: the child of a rank
    (a DataLoader or compile worker) never attaches; the child of a process that is no rank
    may be one (ranks forked by torch.multiprocessing), and takes the session over
    (`continue_in_fork`, launcher/bootstrap/worker.py decides)."""

    config_path: str
    config: MonitorConfig
    build_monitor: MonitorFactory  # a monitor from config_path (launcher/bootstrap/worker.py: the api's TrainerMon)
    pid: int = field(default_factory=os.getpid)
    monitors: list[AttachedMonitor] = field(default_factory=list)
    listeners: list[Listener] = field(default_factory=list)
    error: str | None = None  # why the process was stopped before training, if it was
    stood_down: bool = False  # the script built its own TrainerMon: it monitors itself (hooks/explicit.py)
    stop_said_by_launcher: bool = False  # under `msmon run`: its end-of-job line gives a stop's reason, once
    forked: bool = False  # a forked child that took the session over (`continue_in_fork`)

    @classmethod
    def from_file(cls, config_path: str, build_monitor: MonitorFactory) -> Session:
        return cls(os.path.abspath(config_path), load_config(config_path), build_monitor)

    def in_owner_process(self) -> bool:
        return os.getpid() == self.pid

    def continue_in_fork(self) -> None:
        """This forked child of the session's process is the session's process from now on,
        with no monitor of its own yet."""
        self.pid = os.getpid()
        self.monitors = []
        self.error = None
        self.forked = True

    def may_attach(self) -> bool:
        """Whether an optimizer built (or handed over) here may get a monitor: this is a
        training rank. Not a forked child of the session's process, not a DataLoader worker
        (nor a process the script's own monitor already covers); launcher processes never get
        here, since they build no optimizer."""
        return self.in_owner_process() and not self.stood_down and not in_dataloader_worker()

    def stop(self, reason: str) -> NoReturn:
        """Stop this process before training: one error line, the reason kept for the
        launcher's end-of-job summary, exit code 2."""
        self.error = reason
        logger.log(
            logging.DEBUG if self.stop_said_by_launcher else logging.ERROR,
            "msmon[rank %d]: invalid config %s: %s; stopping before training",
            current_rank(),
            self.config_path,
            reason,
        )
        self.emit("stopped", reason=reason)
        raise StopBeforeTraining(CONFIG_ERROR)

    def emit(self, event: str, **info: Any) -> None:
        """Tell listeners: "attached" (monitor, optimizer, when), "skipped" (optimizer,
        reason), "deferred" (optimizer, reason: left for its first step), "stopped" (reason),
        "closed" (monitor)."""
        for listener in list(self.listeners):
            try:
                listener(event, info)
            except Exception as exc:
                logger.warning("msmon[rank %d]: a %s listener failed: %r", current_rank(), event, exc)


def in_dataloader_worker() -> bool:
    """True in a DataLoader worker process (torch.utils.data.get_worker_info() is set there),
    read without importing torch.utils.data where the script never did."""
    worker = sys.modules.get("torch.utils.data._utils.worker")
    return worker is not None and getattr(worker, "_worker_info", None) is not None


_enabled: dict[str, Framework] = {}  # package name -> its spec, once instrumented


def enable(session: Session) -> None:
    """Switch each instrumentor on when its framework is imported (now, if it already is).
    Each package's light `__init__` is imported here, for the import that switches it on; one
    that cannot be, or exports no Framework, is reported once and never switched on."""
    import wrapt

    specs = registry.frameworks()
    for trigger in dict.fromkeys(spec.switched_on_by for spec in specs):
        names = [spec.name for spec in specs if spec.switched_on_by == trigger]
        wrapt.register_post_import_hook(_on_import(names, session), trigger)


def _on_import(names: list[str], session: Session) -> Callable[[Any], None]:
    def hook(_module: Any) -> None:
        if not session.in_owner_process():
            return
        for name in names:  # in the order frameworks are asked
            instrument(name, session)

    return hook


def _load(name: str) -> Framework | None:
    """The spec of instrumentor package `name`; None, with an error logged, when it cannot be
    imported or exports no Framework, and None unreported when there is no such package."""
    package = f"{__name__}.{name}"
    try:
        return registry.load(name)
    except ModuleNotFoundError as exc:
        if exc.name != package:  # else not written: nothing to switch on
            logger.error("msmon[rank %d]: instrumentor %s cannot be imported: %r", current_rank(), package, exc)
    except Exception as exc:
        logger.error("msmon[rank %d]: instrumentor %s cannot be imported: %r", current_rank(), package, exc)
    return None


def instrument(name: str, session: Session) -> bool:
    """Import instrumentor package `name` (a folder of hooks/) and switch it on; False when it
    is absent or failed."""
    if name in _enabled:
        return True
    framework = _load(name)
    if framework is None:
        return False
    warn_if_unsupported(framework.distribution, framework.supported, framework.switched_on_by)
    try:
        framework.instrument(session)
    except Exception as exc:  # one framework's failure leaves the others on, and training untouched
        logger.error(
            "msmon[rank %d]: instrumentor %s failed to switch on and stays off: %r",
            current_rank(),
            f"{__name__}.{name}",
            exc,
        )
        return False
    _enabled[name] = framework
    return True

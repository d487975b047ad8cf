"""Instrumentors: one package per instrumented library, each attaching msmon to code that never
mentions it, and holding everything msmon knows about that library.

A package `hooks/<name>/` provides, in its light `__init__.py` (it never imports its library;
heavy parts are imported when first used):
- `instrument(session: Session) -> None`, `uninstrument() -> None` (the opentelemetry shape);
- `DISTRIBUTION` and `SUPPORTED` (e.g. "deepspeed", ">=0.17,<0.20"): checked when it switches
  on, one warning when the installed version is outside (monitoring goes on);
and, where the library has them:
- `adapter_for(optimizer) -> OptimizerAdapter | None`: the adapter of its optimizer classes;
- `OPTIMIZER_CLASSES`: names of its optimizer classes that drive an inner torch optimizer
  through `.optimizer` (not wrappers to see through);
- `OPT_TY`: msprobe's opt_ty names -> the adapter class names that fit them;
- `groups_of_models(found, models, adapter)` / `groups_of_process(found)`: its data-, tensor- and
  pipeline-parallel groups, from the models handed over / from the process's parallel state
  (dedupe.py asks every package's first, then every package's second);
- `pipeline_position() -> (stage, group ranks) | None` (hooks/pipeline.py).

`enable(session)` registers a post-import hook (wrapt) on the module that names each library, so
an instrumentor is switched on only when the training script imports its library, right away if
it already did. One that fails is reported once and the others go on.

To add a framework: write the folder `hooks/<name>/` and add its line to INSTRUMENTORS. The
order of the lines is the order the packages are asked: most specific first, so torch_optim,
whose adapter fits any optimizer, comes after the frameworks built on torch.optim.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, NoReturn

from ..config import MonitorConfig, load_config
from ..system.distributed import current_rank

logger = logging.getLogger("msmon")

INSTRUMENTORS: dict[str, str] = {
    # package (folder of hooks/)   the import that switches it on
    "megatron": "megatron.core",
    "deepspeed": "deepspeed",
    "fsdp": "torch.distributed.fsdp",
    "torch_optim": "torch",
    "torch_distributed": "torch",
}

Listener = Callable[[str, dict], None]


class StopBeforeTraining(SystemExit):
    """A config mistake seen only once the model is known (a target that names no module):
    bad input, not a monitoring failure, so the process stops before training instead of
    training unmonitored. A SystemExit: no traceback, and the script's `except Exception`
    cannot swallow it."""


@dataclass
class Session:
    """What the instrumentors of one process share: the config every monitor is built from,
    the monitors attached so far, and who wants to hear about attachments (the launcher's
    worker record). Created in every process of a job that imports torch; whether the process
    is a training rank is decided when it builds an optimizer (or a framework hands one over):
    hooks ask `may_attach()` first. Forked children inherit it in memory and never attach."""

    config_path: str
    config: MonitorConfig
    pid: int = field(default_factory=os.getpid)
    monitors: list[Any] = field(default_factory=list)
    listeners: list[Listener] = field(default_factory=list)
    error: str | None = None  # why the process was stopped before training, if it was
    stood_down: bool = False  # the script built its own TrainerMon: it monitors itself (hooks/explicit.py)

    @classmethod
    def from_file(cls, config_path: str) -> Session:
        return cls(config_path=os.path.abspath(config_path), config=load_config(config_path))

    def in_owner_process(self) -> bool:
        return os.getpid() == self.pid

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
        logger.error(
            "msmon[rank %d]: invalid config %s: %s; stopping before training", current_rank(), self.config_path, reason
        )
        self.emit("stopped", reason=reason)
        raise StopBeforeTraining(2)

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


_enabled: dict[str, Any] = {}  # INSTRUMENTORS key -> its package, once instrumented


@functools.cache
def frameworks() -> tuple[ModuleType, ...]:
    """The instrumentor packages, in INSTRUMENTORS order, for what they declare (adapters,
    opt_ty names, parallel groups). Importing one never imports its library."""
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in INSTRUMENTORS)


def enable(session: Session) -> None:
    """Switch each instrumentor on when its framework is imported (now, if it already is)."""
    import wrapt

    for trigger in dict.fromkeys(INSTRUMENTORS.values()):
        wrapt.register_post_import_hook(_on_import(trigger, session), trigger)


def _on_import(trigger: str, session: Session) -> Callable[[Any], None]:
    def hook(_module: Any) -> None:
        if not session.in_owner_process():
            return
        for name, wanted in INSTRUMENTORS.items():
            if wanted == trigger:
                instrument(name, session)

    return hook


def instrument(name: str, session: Session) -> bool:
    """Import instrumentor package `name` (a key of INSTRUMENTORS) and switch it on; False when
    it is absent or failed."""
    if name in _enabled:
        return True
    package = f"{__name__}.{name}"
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name == package:  # not written yet: nothing to switch on
            return False
        logger.error("msmon[rank %d]: instrumentor %s cannot be imported: %r", current_rank(), package, exc)
        return False
    except Exception as exc:
        logger.error("msmon[rank %d]: instrumentor %s cannot be imported: %r", current_rank(), package, exc)
        return False
    from .core.versions import warn_if_unsupported

    warn_if_unsupported(module.DISTRIBUTION, module.SUPPORTED, INSTRUMENTORS.get(name))
    try:
        module.instrument(session)
    except Exception as exc:  # one framework's failure leaves the others on, and training untouched
        logger.error(
            "msmon[rank %d]: instrumentor %s failed to switch on and stays off: %r", current_rank(), package, exc
        )
        return False
    _enabled[name] = module
    return True

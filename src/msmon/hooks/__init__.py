"""Instrumentors: one per framework, each attaching msmon to code that never mentions it.

An instrumentor is a module with `instrument(session: Session) -> None` and
`uninstrument() -> None` (the opentelemetry shape). `enable(session)` registers a post-import
hook (wrapt) on the module that names each framework, so an instrumentor is imported and
switched on only when the training script imports its framework, right away if it already
did. An instrumentor module that does not exist (yet) is skipped; one that fails is
reported once and the others go on. To add a framework, write `hooks/<name>.py` and add one
line to INSTRUMENTORS.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

from ..config import MonitorConfig, load_config
from ..distributed import current_rank

logger = logging.getLogger("msmon")

INSTRUMENTORS: dict[str, str] = {
    # instrumentor module            the import that switches it on
    "msmon.hooks.torch_optim": "torch",
    "msmon.hooks.torch_distributed": "torch",
    "msmon.hooks.deepspeed": "deepspeed",
    "msmon.hooks.megatron": "megatron.core",
    "msmon.hooks.fsdp": "torch.distributed.fsdp",
    "msmon.hooks.fsdp.accelerate_prepare": "accelerate",
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
    worker record). Created in the one process that monitors; its forked children inherit
    it in memory, so hooks check `in_owner_process()` before attaching anything."""

    config_path: str
    config: MonitorConfig
    pid: int = field(default_factory=os.getpid)
    monitors: list[Any] = field(default_factory=list)
    listeners: list[Listener] = field(default_factory=list)
    error: str | None = None  # why the process was stopped before training, if it was

    @classmethod
    def from_file(cls, config_path: str) -> Session:
        return cls(config_path=os.path.abspath(config_path), config=load_config(config_path))

    def in_owner_process(self) -> bool:
        return os.getpid() == self.pid

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


_enabled: dict[str, Any] = {}  # instrumentor module name -> the module, once instrumented


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
    """Import instrumentor `name` and switch it on; False when it is absent or failed."""
    if name in _enabled:
        return True
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:  # not written yet: nothing to switch on
            return False
        logger.error("msmon[rank %d]: instrumentor %s cannot be imported: %r", current_rank(), name, exc)
        return False
    except Exception as exc:
        logger.error("msmon[rank %d]: instrumentor %s cannot be imported: %r", current_rank(), name, exc)
        return False
    try:
        module.instrument(session)
    except Exception as exc:  # one framework's failure leaves the others on, and training untouched
        logger.error("msmon[rank %d]: instrumentor %s failed to switch on and stays off: %r", current_rank(), name, exc)
        return False
    _enabled[name] = module
    return True


def uninstrument_all() -> None:
    """Switch every instrumentor off (tests; `msmon.auto` never needs it)."""
    for name, module in reversed(list(_enabled.items())):
        try:
            module.uninstrument()
        except Exception as exc:
            logger.warning("msmon: uninstrumenting %s failed: %r", name, exc)
        del _enabled[name]

"""Attach msmon to the optimizer every `deepspeed.initialize` builds (directly, or through HF
Trainer / accelerate, which call it by attribute): ZeRO stages 0-3, no code change.

The engine is handed to the monitor as the model (names lose its `module.` prefix like any
wrapper's) and `engine.optimizer` as the optimizer; the adapter is chosen from its class.
Optimizers built inside `initialize` are left to this instrumentor, and a client optimizer the
script built first (and the torch.optim instrumentor attached to) is released to it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from ...seams.library import library
from ...seams.patching import Replacements
from ...system.distributed import current_rank
from .. import Session
from ..handover import attach, release, suppressed

logger = logging.getLogger("msmon")

_replaced = Replacements()


def instrument(session: Session) -> None:
    _replaced.replace(library("deepspeed"), "initialize", lambda original: _initialize(session, original))


def _initialize(session: Session, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if not session.may_attach():
            return original(*args, **kwargs)
        client = kwargs.get("optimizer", args[2] if len(args) > 2 else None)
        if isinstance(client, torch.optim.Optimizer):
            release(client)  # the engine drives it from now on: its monitor is this one's
        with suppressed():
            result = original(*args, **kwargs)
        try:
            engine = result[0]
            attach(session, engine, getattr(engine, "optimizer", None), "deepspeed.initialize")
        except Exception as exc:  # monitoring must never break the training script
            logger.error(
                "msmon[rank %d]: attaching to the DeepSpeed engine failed; it is not monitored: %r", current_rank(), exc
            )
        return result

    return initialize


def uninstrument() -> None:
    _replaced.restore()

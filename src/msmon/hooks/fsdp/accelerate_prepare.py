"""accelerate under FSDP: the script builds its optimizer over the plain model, then
`Accelerator.prepare` shards the model and points the optimizer at the new, sharded parameters
(FSDP2: `fsdp2_switch_optimizer_parameters`; FSDP1: its own remapping). The monitor the
torch.optim instrumentor attached at construction watches parameters that are no longer
trained, so after `prepare` it is released (an output directory with nothing recorded) and a
new one attached to the prepared model, whose adapter sees the FSDP parameters. Without FSDP
(or when the parameters did not change) nothing happens. HF Trainer's `--fsdp` goes through
the same `prepare`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from ...seams.adapter_choice import resolve_optimizer
from ...seams.library import library
from ...seams.patching import Replacements
from ...system.distributed import current_rank
from .. import Session
from ..handover import attach, release
from .adapters import adapter_for

logger = logging.getLogger("msmon")

_replaced = Replacements()


def instrument(session: Session) -> None:
    accelerate = library("accelerate")
    _replaced.replace(accelerate.Accelerator, "prepare", lambda original: _prepare(session, original))


def _prepare(session: Session, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if session.may_attach():
            try:
                _reattach(session, self, result)
            except Exception as exc:  # monitoring must never break the training script
                logger.error(
                    "msmon[rank %d]: re-attaching after accelerate's FSDP prepare failed: %r", current_rank(), exc
                )
        return result

    return prepare


def uninstrument() -> None:
    _replaced.restore()


def _reattach(session: Session, accelerator: Any, result: Any) -> None:
    """Release and re-attach the monitors of the optimizers `prepare` moved onto FSDP parameters."""
    objects = result if isinstance(result, (tuple, list)) else [result]
    models = [o for o in objects if isinstance(o, torch.nn.Module)]
    for obj in objects:
        if isinstance(obj, torch.nn.Module) or not hasattr(obj, "param_groups"):
            continue
        optimizer = resolve_optimizer(obj)
        if adapter_for(optimizer) is None:
            continue  # not FSDP: prepare kept the parameters (DDP wraps them as they are)
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        model = next((m for m in models if any(id(p) in trained for p in m.parameters())), None)
        monitor = next((m for m in session.monitors if getattr(m, "optimizer", None) is optimizer), None)
        if model is None or (monitor is not None and {id(mp.param) for mp in monitor.params} <= trained):
            continue  # no FSDP model trains it, or its monitor already watches the sharded parameters
        release(optimizer)
        attach(session, model, optimizer, "accelerate prepare (FSDP)")

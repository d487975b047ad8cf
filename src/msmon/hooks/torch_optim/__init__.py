"""torch.optim: attach a TrainerMon to every optimizer a script builds (instrumentor.py), and
read any torch.optim optimizer (adapters.py), the fallback for optimizers no framework claims.

Light on import (its `FRAMEWORK` spec is read by the adapter choice): the instrumentor, which
needs the monitor, is imported when first switched on or asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ...seams.spec import Framework

if TYPE_CHECKING:
    from ...seams.adapters import OptimizerAdapter
    from ...seams.backward_calls import LossScaling
    from .. import Session


def instrument(session: Session) -> None:
    from . import instrumentor

    instrumentor.instrument(session)


def uninstrument() -> None:
    from . import instrumentor

    instrumentor.uninstrument()


def adapter_for(optimizer: Any) -> OptimizerAdapter:
    """Any optimizer with `param_groups`: the last package asked, so it always answers."""
    from .adapters import TorchOptimAdapter

    return TorchOptimAdapter(optimizer)


def release(optimizer: Any) -> bool:
    """Close and forget the monitor attached to `optimizer`: for framework instrumentors that
    take over an optimizer the script built first (`deepspeed.initialize(optimizer=...)`).
    Returns whether there was one."""
    from . import instrumentor

    return instrumentor.release(optimizer)


def claim(optimizer: Any) -> None:
    """Mark `optimizer` as handled by someone else (a framework's monitor): never attach to it."""
    from . import instrumentor

    instrumentor.claim(optimizer)


@contextmanager
def suppressed() -> Iterator[None]:
    """Optimizers built inside this block are left alone: for framework instrumentors
    (DeepSpeed, Megatron) that attach to the optimizers they build themselves."""
    from . import instrumentor

    with instrumentor.suppressed():
        yield


def loss_scaling() -> LossScaling:
    """torch's GradScaler: `scale(loss)` returns `loss * self._scale` (torch.cuda.amp's is a subclass)."""
    import torch

    from ...seams.backward_calls import LossScaling, Scaler

    return LossScaling(scalers=(Scaler(torch.amp.GradScaler, "scale", lambda scaler: scaler._scale),))


FRAMEWORK = Framework(
    name="torch_optim",
    switched_on_by="torch",
    precedence=90,  # after every framework built on torch.optim: its adapter fits any optimizer
    distribution="torch",
    supported=">=2.1,<2.14",  # pyproject's floor; tested on 2.13
    instrument=instrument,
    uninstrument=uninstrument,
    adapter_for=adapter_for,
    loss_scaling=loss_scaling,
)

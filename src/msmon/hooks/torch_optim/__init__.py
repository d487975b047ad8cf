"""torch.optim: attach a TrainerMon to every optimizer a script builds (instrumentor.py), and
read any torch.optim optimizer (seams/adapters.py's TorchOptimAdapter, which the framework
packages' adapters build on too), the fallback for optimizers no framework claims.

Light on import (its `FRAMEWORK` spec is read by the adapter choice): the instrumentor, which
needs the monitor, is imported when first switched on or asked.
"""

from __future__ import annotations

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
    from ...seams.adapters import TorchOptimAdapter

    return TorchOptimAdapter(optimizer)


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

"""What every optimizer adapter provides, and how wrappers are seen through."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

_WRAPPER_ATTRS = ("optimizer", "_optimizer")


def resolve_optimizer(optimizer: Any) -> Any:
    """The real optimizer under wrappers (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer, HF's wrappers): follow `.optimizer` / `._optimizer` while they lead to
    another object with `step` and `param_groups`."""
    seen = set()
    current = optimizer
    while id(current) not in seen:
        seen.add(id(current))
        for attr in _WRAPPER_ATTRS:
            inner = getattr(current, attr, None)
            if inner is not None and inner is not current and hasattr(inner, "step") and hasattr(inner, "param_groups"):
                current = inner
                break
        else:
            break
    return current


@dataclass
class Moments:
    """Adam state of one parameter, as the optimizer holds it."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: Any  # int, float or a (device) tensor
    beta1: float
    beta2: float
    eps: float


class OptimizerAdapter:
    """Family-specific access to an optimizer; see TorchOptimAdapter for the plain case."""

    family = "base"

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def weights(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The tensor reported as each parameter's weight, keyed by id(param): the parameter
        itself here; an fp32 master copy (or its local shard) for mixed-precision families."""
        return {id(p): p for p in params}

    def grads(self, params: list[torch.Tensor],
              grad_of: Callable[[torch.Tensor], torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """The gradient the optimizer consumes at step time, keyed by id(param)."""
        out = {}
        for p in params:
            g = grad_of(p)
            if g is not None:
                out[id(p)] = g
        return out

    def moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        """Adam moments keyed by id(param), for the params that have them."""
        raise NotImplementedError

    def hook_step(self, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
        """Call `before` once the gradients are final (after a closure ran) and `after` once the
        update is applied. Returns a function that removes the hooks."""
        raise NotImplementedError

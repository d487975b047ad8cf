"""torch.optim optimizers (any subclass, including user-defined ones): the parameters are what
the optimizer steps, gradients their `.grad`, moments its `state`. The fallback adapter, for
any optimizer no framework package claims."""

from __future__ import annotations

import torch

from ...seams.adapters import Moments, OptimizerAdapter, inner_moments


class TorchOptimAdapter(OptimizerAdapter):
    family = "torch"

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        return inner_moments(self.optimizer, {id(p): id(p) for p in params})

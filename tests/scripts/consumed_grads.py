"""What the inner torch optimizers of a framework receive, as the truth for `grad_reduced`.

The test scripts register this step pre-hook themselves on the torch optimizer that DeepSpeed or
Megatron finally steps (after clipping and unscaling inside their own `step()`), and sum, in
plain torch, the squares, the values and the largest magnitude of the gradients it is about to
consume, over every inner step of an optimizer step; over the data-parallel ranks where each
holds a partition of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ConsumedGradients:
    """One inner torch optimizer's received gradients, summed until `take`."""

    def __init__(self, inner: torch.optim.Optimizer, partitioned: bool) -> None:
        self.partitioned = partitioned
        self._reset()
        inner.register_step_pre_hook(self)

    def _reset(self) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64)  # squares, values
        self.absmax = torch.zeros(1, dtype=torch.float64)
        self.inner_steps = 0

    def __call__(self, inner: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
        self.inner_steps += 1
        for group in inner.param_groups:
            for t in group["params"]:
                if t.grad is not None and t.grad.numel():
                    g = t.grad.detach().double()
                    self.sums += torch.stack([(g * g).sum(), g.sum()])
                    self.absmax = torch.maximum(self.absmax, g.abs().max().reshape(1))

    @staticmethod
    def take(captures: list[ConsumedGradients]) -> dict:
        """This step's totals over every capture (a collective on the partitioned ones)."""
        sums, absmax = torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        for c in captures:
            if c.partitioned:
                dist.all_reduce(c.sums)
                dist.all_reduce(c.absmax, op=dist.ReduceOp.MAX)
            sums += c.sums
            absmax = torch.maximum(absmax, c.absmax)
        out = {
            "norm": float(sums[0].sqrt()),
            "sum": float(sums[1]),
            "absmax": float(absmax[0]),
            "inner_steps": min(c.inner_steps for c in captures),
        }
        for c in captures:
            c._reset()
        return out

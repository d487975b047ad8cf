"""The statistics of scalars taken as one-element tensors (what msprobe's ops give for
mg_direction's share), each op by the field or the compute function of its table entry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

from .inputs import RESULT_DTYPE
from .ops import BY_NAME, unknown, with_dependencies

# Each field of a one-element tensor x: its norm |x|, min = max = sum = x, its zero count
# (|x| < eps) and its nan and inf counts; per-element ops are divided by a count of 1.
_OF_SCALAR: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "norm": lambda x, eps: x.abs(),
    "min": lambda x, eps: x,
    "max": lambda x, eps: x,
    "sum": lambda x, eps: x,
    "zeros": lambda x, eps: (x.abs() < eps).to(RESULT_DTYPE),
    "nans": lambda x, eps: torch.isnan(x).to(RESULT_DTYPE),
    "infs": lambda x, eps: torch.isinf(x).to(RESULT_DTYPE),
}


def _computed(x: torch.Tensor, compute: Callable[[Any, Any], Any]) -> torch.Tensor:
    """An op's own compute function, of each scalar as a one-element tensor."""
    if not x.numel():
        return x.new_empty(0)
    return torch.stack([compute(value.view(1), RESULT_DTYPE) for value in x]).to(RESULT_DTYPE)


def scalar_rows(values: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """[n, ops] statistics of n scalars, each taken as a one-element tensor (what msprobe's ops
    give for mg_direction): norm |x|, min = max = mean = x, zeros 1 or 0, nans and infs 0 or 1."""
    x = values.to(RESULT_DTYPE)
    columns: dict[str, torch.Tensor] = {}
    for name in with_dependencies(ops):
        op = BY_NAME.get(name)
        if op is None:
            raise ValueError(unknown(name))
        if op.derive is None:
            columns[name] = _OF_SCALAR[op.field](x, eps) if op.compute is None else _computed(x, op.compute)
    for name in ops:  # a derived op (std) of one element each: its bases' and a count of 1
        derive = BY_NAME[name].derive
        if derive is not None:
            columns[name] = derive({base: columns[base] for base in BY_NAME[name].derived_from}, torch.ones_like(x))
    return torch.stack([columns[name] for name in ops], dim=1) if ops else x.new_empty((x.numel(), 0))

"""The statistics of scalars taken as one-element tensors (what msprobe's ops give for
mg_direction's share)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .inputs import RESULT_DTYPE
from .ops import unknown


def scalar_rows(values: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """[n, ops] statistics of n scalars, each taken as a one-element tensor (what msprobe's ops
    give for mg_direction): norm |x|, min = max = mean = x, zeros 1 or 0, nans and infs 0 or 1."""
    x = values.to(RESULT_DTYPE)
    columns = []
    for op in ops:
        if op == "norm":
            columns.append(x.abs())
        elif op in ("min", "max", "mean"):
            columns.append(x)
        elif op == "zeros":
            columns.append((x.abs() < eps).to(RESULT_DTYPE))
        elif op == "nans":
            columns.append(torch.isnan(x).to(RESULT_DTYPE))
        elif op == "infs":
            columns.append(torch.isinf(x).to(RESULT_DTYPE))
        else:
            raise ValueError(unknown(op))
    return torch.stack(columns, dim=1) if columns else x.new_empty((x.numel(), 0))

"""Exact statistics of a tensor from those of its disjoint pieces (ZeRO partitions, the calls
of one communication op, the ranks' shards), each op by its combine rule (msmon.stats.ops)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .ops import BY_NAME


class _OverAll:
    """Reductions over every element: the pieces of one tensor, a [pieces] column."""

    sum = staticmethod(torch.Tensor.sum)
    min = staticmethod(torch.Tensor.min)
    max = staticmethod(torch.Tensor.max)


class _OverRanks:
    """Reductions along dim 0: the ranks' pieces of many tensors, a [ranks, tensors] column."""

    @staticmethod
    def sum(x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)

    @staticmethod
    def min(x: torch.Tensor) -> torch.Tensor:
        return x.amin(0)

    @staticmethod
    def max(x: torch.Tensor) -> torch.Tensor:
        return x.amax(0)


def combine_rows(rows: torch.Tensor, counts: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """Exact statistics of a tensor from the statistics of its disjoint pieces.

    rows: [pieces, ops] statistics of each piece; counts: [pieces] element counts. Each op
    combines by its rule (msmon.stats.ops): norms add in squares, min of mins, max of maxes, means
    weighted by count, zero counts recovered from each fraction (so the combined fraction is
    exactly the directly computed one), nan and inf counts add up. Empty pieces (count 0, NaN
    rows) are left out; if every piece is empty the result is a NaN row, like the statistics of
    an empty tensor. No host sync.
    """
    counts = counts.to(device=rows.device, dtype=rows.dtype)
    keep = counts > 0
    total = counts.sum()
    columns = [BY_NAME[op].combine(_OverAll, rows[:, j], counts, keep, total) for j, op in enumerate(ops)]
    return torch.where(total > 0, torch.stack(columns), math.nan)


def combine_gathered(rows: torch.Tensor, counts: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """combine_rows for many tensors at once: [ranks, tensors, ops] piece statistics with
    [ranks, tensors] element counts give [tensors, ops] statistics of the whole tensors."""
    counts = counts.to(rows.dtype)
    keep = counts > 0
    total = counts.sum(0)
    columns = [BY_NAME[op].combine(_OverRanks, rows[..., j], counts, keep, total) for j, op in enumerate(ops)]
    return torch.where((total > 0).unsqueeze(-1), torch.stack(columns, dim=-1), math.nan)

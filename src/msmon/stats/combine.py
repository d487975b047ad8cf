"""Exact statistics of a tensor from those of its disjoint pieces (ZeRO partitions, the calls
of one communication op, the ranks' shards), each op by its combine rule (msmon.stats.ops); a
derived op (`std`) derived again from its bases, combined by theirs, which the rows must hold
(`ops` as msmon.stats.ops.with_dependencies gives them: every row of a step does)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .ops import BY_NAME, with_dependencies


def _columns(r: Any, rows: torch.Tensor, counts: torch.Tensor, keep: Any, total: Any, ops: Sequence[str]) -> list:
    """Each op's combined column; a derived op's from its bases' combined columns."""
    columns: list[Any] = [None] * len(ops)
    derived = []
    for j, op in enumerate(ops):
        entry = BY_NAME[op]
        if entry.derive is not None:
            derived.append((j, entry.derive, entry.derived_from))
        elif entry.combine is not None:
            columns[j] = entry.combine(r, rows[..., j], counts, keep, total)
    if derived and list(ops) != with_dependencies(ops):
        raise ValueError(f"ops {list(ops)}: a derived op's pieces combine only with its bases in the rows")
    for j, derive, bases in derived:
        columns[j] = derive({base: columns[ops.index(base)] for base in bases}, total)
    return columns


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
    columns = _columns(_OverAll, rows, counts, keep, total, ops)
    return torch.where(total > 0, torch.stack(columns), math.nan)


def combine_gathered(rows: torch.Tensor, counts: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """combine_rows for many tensors at once: [ranks, tensors, ops] piece statistics with
    [ranks, tensors] element counts give [tensors, ops] statistics of the whole tensors."""
    counts = counts.to(rows.dtype)
    keep = counts > 0
    total = counts.sum(0)
    columns = _columns(_OverRanks, rows, counts, keep, total, ops)
    return torch.where((total > 0).unsqueeze(-1), torch.stack(columns, dim=-1), math.nan)

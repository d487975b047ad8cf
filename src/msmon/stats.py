"""Statistics of tensors, computed on the tensors' own device without any host sync.

The result of every function here is a float64 tensor on the input's device, one row per
tensor and one column per op in the order asked for; counts (nans, infs) are exact in float64.
Lists are batched with foreach kernels where torch has them, so a step's worth of tensors
costs a handful of kernel launches per op rather than one Python round trip per value.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

RESULT_DTYPE = torch.float64


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a tensor (a DTensor's local shard, otherwise the tensor)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _as_stat_input(t: torch.Tensor) -> torch.Tensor:
    t = local_tensor(t).detach()
    if t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex()):
        t = t.to(torch.float32)
    return t


def _column(op: str, ts: list[torch.Tensor], eps: float, numel: torch.Tensor,
            cache: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    if op == "norm":
        values = torch._foreach_norm(ts, 2, dtype=torch.float32)
        return torch.stack(values).to(RESULT_DTYPE)
    if op in ("min", "max"):
        if "minmax" not in cache:
            cache["minmax"] = [torch.stack(torch.aminmax(t)) for t in ts]
        pairs = torch.stack(cache["minmax"]).to(RESULT_DTYPE)
        return pairs[:, 0] if op == "min" else pairs[:, 1]
    if op == "mean":
        acc = torch.float64 if ts[0].dtype == torch.float64 else torch.float32
        sums = torch.stack([t.sum(dtype=acc) for t in ts]).to(RESULT_DTYPE)
        return sums / numel
    if op == "zeros":
        counts = torch.stack([torch.count_nonzero(t.abs() < eps) for t in ts]).to(RESULT_DTYPE)
        return counts / numel
    if op == "nans":
        return torch.stack([torch.count_nonzero(torch.isnan(t)) for t in ts]).to(RESULT_DTYPE)
    if op == "infs":
        return torch.stack([torch.count_nonzero(torch.isinf(t)) for t in ts]).to(RESULT_DTYPE)
    raise ValueError(f"unknown op {op!r}")


def _same_kind_stats(ts: list[torch.Tensor], ops: Sequence[str], eps: float) -> torch.Tensor:
    numel = torch.tensor([t.numel() for t in ts], dtype=RESULT_DTYPE).to(ts[0].device, non_blocking=True)
    cache: dict[str, list[torch.Tensor]] = {}
    return torch.stack([_column(op, ts, eps, numel, cache) for op in ops], dim=1)


@torch.no_grad()
def batch_stats(tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float) -> torch.Tensor:
    """Statistics of many tensors: a [len(tensors), len(ops)] float64 tensor.

    Tensors are grouped by (device, dtype) so each group is one set of foreach calls; rows
    come back in input order on the first tensor's device. Empty tensors give NaN rows.
    """
    if not tensors:
        return torch.empty((0, len(ops)), dtype=RESULT_DTYPE)
    prepared = [_as_stat_input(t) for t in tensors]
    device = prepared[0].device
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    empty: list[int] = []
    for i, t in enumerate(prepared):
        (empty if t.numel() == 0 else groups[(t.device, t.dtype)]).append(i)
    if len(groups) == 1 and not empty:
        return _same_kind_stats(prepared, ops, eps)
    out = torch.full((len(prepared), len(ops)), float("nan"), dtype=RESULT_DTYPE, device=device)
    for indices in groups.values():
        rows = _same_kind_stats([prepared[i] for i in indices], ops, eps)
        out[torch.tensor(indices, device=device)] = rows.to(device, non_blocking=True)
    return out


@torch.no_grad()
def tensor_stats(tensor: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """Statistics of one tensor: a [len(ops)] float64 tensor on its device."""
    return batch_stats([tensor], ops, eps)[0]


def combine_rows(rows: torch.Tensor, counts: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """Exact statistics of a tensor from the statistics of its disjoint pieces.

    rows: [pieces, ops] statistics of each piece; counts: [pieces] element counts. Norms add
    in squares, min of mins, max of maxes, means and zero-fractions weighted by count, nan and
    inf counts add up. Used for sharded parameters and for collectives aggregated over a step.
    """
    counts = counts.to(rows.dtype)
    total = counts.sum()
    columns = []
    for j, op in enumerate(ops):
        col = rows[:, j]
        if op == "norm":
            columns.append(col.square().sum().sqrt())
        elif op == "min":
            columns.append(col.min())
        elif op == "max":
            columns.append(col.max())
        elif op in ("mean", "zeros"):
            columns.append((col * counts).sum() / total)
        else:
            columns.append(col.sum())
    return torch.stack(columns)

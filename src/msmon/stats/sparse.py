"""Statistics of a sparse gradient (`nn.Embedding(sparse=True)`, read by SparseAdam) as those of
the dense tensor it stands for, without making that dense tensor.

A sparse tensor stores some values and means zeros everywhere else; its statistics are the
exact combination (msmon.stats.combine.combine_rows) of its stored values, coalesced (duplicate indices
summed, as the dense tensor has them), and of the zeros it does not store. A dense copy would
need the whole embedding table's memory, which is what a sparse gradient avoids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .combine import combine_rows
from .engine import batch_stats, tensor_stats


def is_sparse(t: torch.Tensor) -> bool:
    return t.layout is not torch.strided


def _stored_values(t: torch.Tensor) -> torch.Tensor:
    """The values of the dense tensor's elements the sparse one stores, each once."""
    if t.layout is torch.sparse_coo:
        return t.coalesce().values()
    return t.values()  # the compressed layouts (CSR, CSC, BSR, BSC) hold no duplicates


def sparse_stats(t: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """Statistics of `t.to_dense()`, computed from its stored values: a [len(ops)] float64 row."""
    values = _stored_values(t.detach())
    stored = values.numel()
    zero = torch.zeros(1, dtype=values.dtype, device=values.device)
    rows = torch.stack([tensor_stats(values, ops, eps), tensor_stats(zero, ops, eps)])
    counts = torch.tensor([stored, t.numel() - stored], dtype=torch.float64)
    return combine_rows(rows, counts, ops)


def any_layout_stats(tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float) -> torch.Tensor:
    """engine.batch_stats that also takes sparse tensors: the dense ones in one batch, rows in order."""
    dense = [i for i, t in enumerate(tensors) if not is_sparse(t)]
    if len(dense) == len(tensors):
        return batch_stats(tensors, ops, eps)
    rows: list[torch.Tensor | None] = [None] * len(tensors)
    if dense:
        for i, row in zip(dense, batch_stats([tensors[i] for i in dense], ops, eps)):
            rows[i] = row
    for i, t in enumerate(tensors):
        if rows[i] is None:
            rows[i] = sparse_stats(t, ops, eps)
    device = next(r for r in rows if r is not None).device
    return torch.stack([r.to(device) for r in rows if r is not None])

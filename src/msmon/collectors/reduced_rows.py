"""grad_reduced rows: the gradients as the optimizer consumes them, each read once. A gradient
that is still the tensor, data and version grad_unreduced's row describes (no reduction
happened: a single process, or a framework that reduced elsewhere) reuses that row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..output.records import RowKey, row_key
from ..runtime.step_context import StepContext
from ..stats.sparse import any_layout_stats
from .grad_tensors import identity


@dataclass
class ReducedRows:
    """A step's grad_reduced rows, computed and not yet in the buffer: `rows` [n, ops], one per
    parameter index of `indices`, each read from the gradient at the same place in `grads`."""

    keys: list[RowKey]
    indices: list[int]
    grads: list[torch.Tensor]
    rows: torch.Tensor

    def add_to(self, ctx: StepContext) -> None:
        ctx.buffer.add_many(self.keys, self.rows)

    def described(self) -> dict[int, tuple[torch.Tensor, int]]:
        """index -> (the gradient its row was read from, the row's position)."""
        return {index: (grad, j) for j, (index, grad) in enumerate(zip(self.indices, self.grads))}

    def column(self, ops: list[str], op: str = "norm") -> torch.Tensor | None:
        """The rows' `op` column ([n], on the rows' device), None when it is not among `ops`."""
        ops = list(ops)
        return self.rows[:, ops.index(op)] if op in ops else None


def reduced_rows(
    ctx: StepContext,
    values: dict,
    last_rows: dict[int, torch.Tensor],
    last_identity: dict[int, tuple[int, int, int]],
) -> ReducedRows | None:
    """grad_reduced rows of `values` (adapter.grads' answer, or part of it); shards among them
    are recorded on their own (runtime.shards), None when no other row is left."""
    reused: dict[int, torch.Tensor] = {}
    fresh: list[int] = []
    grads: dict[int, torch.Tensor] = {}
    consumed = ctx.shards.take("grad_reduced", values)
    for index, mp in enumerate(ctx.params):
        grad = consumed.get(id(mp.param))
        if grad is None:
            continue
        grads[index] = grad
        if index in last_rows and last_identity.get(index) == identity(grad):
            reused[index] = last_rows[index]
        else:
            fresh.append(index)
    fresh_rows = any_layout_stats([grads[i] for i in fresh], ctx.step_ops, ctx.config.eps) if fresh else None
    order = sorted(list(reused) + fresh)
    if not order:
        return None
    position = {index: i for i, index in enumerate(fresh)}
    # the ignore: fresh_rows is None only when nothing is fresh, and then it is never indexed
    rows = [reused[i] if i in reused else fresh_rows[position[i]] for i in order]  # type: ignore[index]
    keys = [row_key("grad_reduced", ctx.params[i].name, ctx.params[i].vpp_stage) for i in order]
    stacked = torch.stack([r.to(rows[0].device) for r in rows])
    return ReducedRows(keys, order, [grads[i] for i in order], stacked)


def record_reduced(
    ctx: StepContext,
    values: dict,
    last_rows: dict[int, torch.Tensor],
    last_identity: dict[int, tuple[int, int, int]],
) -> None:
    """grad_reduced rows of `values`, into the step's buffer."""
    found = reduced_rows(ctx, values, last_rows, last_identity)
    if found is not None:
        found.add_to(ctx)

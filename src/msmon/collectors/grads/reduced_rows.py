"""The rows a step's gradients give when the optimizer steps: grad_reduced, the gradients as the
optimizer consumes them, each read once (a gradient that is still the tensor, data and version
grad_unreduced's row describes, its `identity`, reuses that row: no reduction happened, a single
process or a framework that reduced elsewhere), and the step's grad_unreduced rows themselves
when they are recorded once per step (not per micro-batch)."""

from __future__ import annotations

import torch

from ...records.rows import row_key
from ...runtime.step_context import StepContext
from ...stats.sparse import any_layout_stats


def identity(t: torch.Tensor) -> tuple[int, int, int]:
    """The tensor, its data and its version: what a row of it describes."""
    # a sparse tensor has no one data pointer (stats.sparse.is_sparse, inline: a call per hook)
    return id(t), t.data_ptr() if t.layout is torch.strided else 0, t._version


def record_unreduced(ctx: StepContext, last_rows: dict[int, torch.Tensor]) -> None:
    """The step's grad_unreduced rows: the last accumulated row of each gradient, in the order
    their hooks fired (monitor_mbs_grad off)."""
    indices = list(last_rows)
    keys = [row_key("grad_unreduced", ctx.params[i].name, ctx.params[i].vpp_stage) for i in indices]
    ctx.buffer.add_many(keys, torch.stack([last_rows[i] for i in indices]))


def record_reduced(
    ctx: StepContext,
    values: dict,
    last_rows: dict[int, torch.Tensor],
    last_identity: dict[int, tuple[int, int, int]],
) -> None:
    """grad_reduced rows of `values` (adapter.grads' answer, or part of it)."""
    reused: dict[int, torch.Tensor] = {}
    fresh: list[int] = []
    grads: list[torch.Tensor] = []
    consumed = ctx.shards.take("grad_reduced", values)
    for index, mp in enumerate(ctx.params):
        grad = consumed.get(id(mp.param))
        if grad is None:
            continue
        if index in last_rows and last_identity.get(index) == identity(grad):
            reused[index] = last_rows[index]
        else:
            fresh.append(index)
            grads.append(grad)
    fresh_rows = any_layout_stats(grads, ctx.step_ops, ctx.config.eps) if grads else None
    order = sorted(list(reused) + fresh)
    if not order:
        return
    position = {index: i for i, index in enumerate(fresh)}
    # the ignore: fresh_rows is None only when nothing is fresh, and then it is never indexed
    rows = [reused[i] if i in reused else fresh_rows[position[i]] for i in order]  # type: ignore[index]
    keys = [row_key("grad_reduced", ctx.params[i].name, ctx.params[i].vpp_stage) for i in order]
    ctx.buffer.add_many(keys, torch.stack([r.to(rows[0].device) for r in rows]))

"""Where FSDP1's NO_SHARD reduces whole gradients (torch 2.x `_runtime_utils`), for the gradient
agreement (collectors/grads/agreement.py).

A NO_SHARD unit keeps the whole flat parameter on every rank, and its post-backward hook (an
AccumulateGrad node hook on the FlatParameter) all-reduces the whole flat gradient in place
(`_reduce_grad_no_shard`), unless `no_sync()` holds the reduction back. A tensor
post-accumulate-grad hook on the same FlatParameter runs inside that AccumulateGrad, before the
node's hooks (seams.py), when `.grad` is still this rank's own flat gradient: `before(pairs)`
gets each original parameter's view of it there. FSDP's end-of-backward callback then points
the original parameters' `.grad` at their views of the reduced flat gradient; `after()` runs
after it (an autograd callback queued from within one queued during backward runs after all of
them). Original parameters only (`use_orig_params=True`), and only where every unit is NO_SHARD:
a sharded unit keeps only its shard of the reduced gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...seams.reduction_seam import stop_following
from .seams import removal_of, unsharded_views


def _units(models: list[Any]) -> list[Any]:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return []
    return [
        m
        for model in models
        for m in model.modules()
        if isinstance(m, FullyShardedDataParallel) and getattr(m, "_handle", None) is not None
    ]


def whole_gradient_reduction(
    models: list[Any], optimizer: Any, before: Callable[[list[Any] | None], None], after: Callable[[], None]
) -> Callable[[], None] | None:
    """`before(pairs)` with each NO_SHARD unit's (original parameter, its rank-local gradient)
    right before FSDP all-reduces the flat gradient, `after()` at the end of that backward pass;
    None where a unit is sharded, or a flat parameter has no original parameters."""
    units = _units(models)
    if not units or any(u._handle.uses_sharded_strategy or not u._handle._use_orig_params for u in units):
        return None
    queued: dict[str, Any] = {"task": None, "failed": False}
    engine = torch.autograd.Variable._execution_engine

    def at_end() -> None:
        queued["task"] = None
        after()

    handles = []
    for unit in units:
        flat_param = unit._handle.flat_param
        originals = list(flat_param._params or [])
        if not originals:
            continue

        def on_accumulated(flat: Any, _unit: Any = unit, _originals: list = originals) -> None:
            if queued["failed"]:
                return
            try:
                grad = flat.grad
                if grad is None or grad.numel() < sum(flat._numels) or not _unit._sync_gradients:
                    return  # no_sync(): no reduction follows
                pairs = list(zip(_originals, unsharded_views(flat, grad)))
            except Exception as exc:  # an FSDP of another layout: the agreement is off, training goes on
                stop_following(queued, "read FSDP's flat gradient", exc)
                return
            before(pairs)
            task = torch._C._current_graph_task_id()
            if queued["task"] != task:
                queued["task"] = task
                engine.queue_callback(lambda: engine.queue_callback(at_end))

        handles.append(flat_param.register_post_accumulate_grad_hook(on_accumulated))
    return removal_of(handles)

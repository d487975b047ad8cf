"""Where Megatron's DDP reduces whole gradients (layout of megatron-core 0.16), for the gradient
agreement (collectors/grads/agreement.py).

Megatron's DistributedDataParallel accumulates each parameter's gradient into `main_grad`, a
view of its bucket's `grad_data`, and each bucket group reduces its buckets in
`start_grad_sync` (scaled by 1/dp, then all-reduced; called from the backward hooks with
overlap_grad_reduce, else from `finish_grad_sync`), done once `finish_grad_sync` returns.
Without the distributed optimizer that reduction is an all-reduce: afterwards every rank holds
the whole average in `main_grad`. So a bucket group's `main_grad`s are the rank's own gradients
right before its `start_grad_sync` and the whole average right after its `finish_grad_sync`:
`before(pairs)` (each parameter with its `main_grad`) runs at the first, and `after()` once
every bucket group of the model chunks has finished. Both methods are wrapped on the bucket-group instances.

Not here: the distributed optimizer (`use_distributed_optimizer`, or a DistributedOptimizer
among the optimizers) reduce-scatters, and a rank keeps only its shard of the reduced gradient.
"""

from __future__ import annotations

from typing import Any, Callable

from ...seams.adapters import class_names
from ...seams.patching import wrap_method


def _sharded(models: list[Any], optimizer: Any) -> bool:
    """Whether the gradient is reduce-scattered (the distributed optimizer, anywhere)."""
    if any(getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False) for chunk in models):
        return True
    optimizers = [optimizer, *(getattr(optimizer, "chained_optimizers", None) or [])]
    return any("DistributedOptimizer" in class_names(o) for o in optimizers)


def whole_gradient_reduction(
    models: list[Any], optimizer: Any, before: Callable[[list[Any] | None], None], after: Callable[[], None]
) -> Callable[[], None] | None:
    """`before(pairs)` right before each bucket group's reduction, `after()` once all of them
    are done; None (nothing wrapped) with the distributed optimizer or no Megatron DDP chunk."""
    chunks = [chunk for chunk in models if getattr(chunk, "bucket_groups", None)]
    if not chunks or _sharded(models, optimizer):
        return None
    groups = [
        group
        for chunk in chunks
        for group in list(chunk.bucket_groups) + list(getattr(chunk, "expert_parallel_bucket_groups", None) or [])
    ]
    started: set[int] = set()
    finished: set[int] = set()
    undo: list[Callable[[], None]] = []

    for group in groups:

        def on_start(*_args: Any, _group: Any = group, **_kwargs: Any) -> None:
            if id(_group) in started:  # finish_grad_sync without overlap calls start_grad_sync again
                return
            started.add(id(_group))
            before([(p, p.main_grad) for p in _group.params if getattr(p, "main_grad", None) is not None])

        def on_finish(_result: Any, *_args: Any, _group: Any = group, **_kwargs: Any) -> None:
            finished.add(id(_group))
            if len(finished) == len(groups):
                started.clear()
                finished.clear()
                after()

        undo.append(wrap_method(group, "start_grad_sync", before=on_start))
        undo.append(wrap_method(group, "finish_grad_sync", after=on_finish))

    def remove() -> None:
        for u in reversed(undo):
            u()

    return remove

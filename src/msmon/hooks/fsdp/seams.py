"""Where FSDP hands the rank-local gradients to the reduce-scatter (`grad_unreduced`).

FSDP2: its parameter group's `post_backward` calls `foreach_reduce(fsdp_params,
unsharded_grads, ...)` with each parameter's whole rank-local gradient (accumulated over the
micro-batches that did not reduce, already unpadded) right before copying them into the
reduce-scatter buffer. The name is looked up in `_fsdp_param_group`'s globals at each call,
so wrapping it there (msprobe's seam) sees every reduction and nothing else; the wrapper is
installed while a monitor wants it and only reads the gradients. FSDP2 has no public hook at
this point: `set_custom_reduce_scatter` gets the flat, padded buffer and replaces the user's
own, `register_post_accumulate_grad_hook` would need the private unsharded parameters.

FSDP1: the unit's post-backward hook is an AccumulateGrad node hook on the FlatParameter;
a tensor post-accumulate-grad hook on the same FlatParameter (public autograd API) runs
inside that AccumulateGrad, before the node's hooks, when `.grad` is the whole unsharded
flat gradient of this rank. Each original parameter's gradient is a view of it, located
with the flat parameter's own layout (`_numels_with_padding`, `_is_padding_mask`, `_shapes`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

import torch

from ...seams.adapters import GradPairs

logger = logging.getLogger("msmon")

# where FSDP2's parameter group looks `foreach_reduce` up: torch >= 2.6, then 2.4-2.5
_FSDP2_GROUP_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",
    "torch.distributed._composable.fsdp._fsdp_param_group",
)

_listeners: list[Callable[[list, list], None]] = []
_patched: tuple[Any, Any] | None = None  # (module, the original foreach_reduce)


def _fsdp2_group_module() -> Any:
    for name in _FSDP2_GROUP_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(module, "foreach_reduce", None)):
            return module
    return None


def _install() -> bool:
    global _patched
    if _patched is not None:
        return True
    module = _fsdp2_group_module()
    if module is None:
        return False
    original = module.foreach_reduce

    def foreach_reduce(fsdp_params: list, unsharded_grads: list, *args: Any, **kwargs: Any) -> Any:
        for listener in list(_listeners):
            listener(fsdp_params, unsharded_grads)  # each guarded by its collector
        return original(fsdp_params, unsharded_grads, *args, **kwargs)

    foreach_reduce.__wrapped__ = original  # type: ignore[attr-defined]
    module.foreach_reduce = foreach_reduce
    _patched = (module, original)
    return True


def _uninstall() -> None:
    global _patched
    if _patched is not None and not _listeners:
        module, original = _patched
        if getattr(module.foreach_reduce, "__wrapped__", None) is original:
            module.foreach_reduce = original
        _patched = None


def on_fsdp2_reduce(param_ids: set[int], record: Callable[[GradPairs], None]) -> Callable[[], None] | None:
    """Call `record` with (sharded parameter, its rank-local unsharded gradient) right before
    each FSDP2 reduce-scatter of `param_ids`. Returns the undo; None when this torch has no such seam."""
    if not _install():
        logger.warning("msmon: this torch's FSDP2 has no foreach_reduce to read rank-local gradients at")
        return None

    def listener(fsdp_params: list, grads: list) -> None:
        pairs = [(fp.sharded_param, g) for fp, g in zip(fsdp_params, grads) if id(fp.sharded_param) in param_ids]
        if pairs:
            record(pairs)

    _listeners.append(listener)

    def undo() -> None:
        if listener in _listeners:
            _listeners.remove(listener)
        _uninstall()

    return undo


def unsharded_views(flat_param: Any, grad: torch.Tensor) -> list[torch.Tensor]:
    """The original parameters' pieces of an unsharded flat tensor, in `_params` order (padding skipped)."""
    flat = grad.reshape(-1)
    shapes = iter(flat_param._shapes)
    views, offset = [], 0
    for numel, padding in zip(flat_param._numels_with_padding, flat_param._is_padding_mask):
        if not padding:
            views.append(flat.narrow(0, offset, numel).view(next(shapes)))
        offset += numel
    return views


def on_fsdp1_reduce(
    flats: list[tuple[Any, list[Any]]], record: Callable[[GradPairs], None]
) -> Callable[[], None] | None:
    """Call `record` with (key of an original parameter, its rank-local gradient) each time a
    flat parameter's unsharded gradient is complete, right before FSDP1 reduce-scatters it.
    `flats`: each FlatParameter with the keys its originals are monitored under, in `_params`
    order (None for one not monitored)."""
    handles = []
    for flat_param, keys in flats:
        if not any(k is not None for k in keys):
            continue

        def on_accumulated(flat: Any, keys: list = keys) -> None:
            grad = flat.grad
            if grad is None or grad.numel() < sum(flat._numels):
                return  # a sharded gradient (no reduction follows): nothing rank-local to read
            pairs = [(k, g) for k, g in zip(keys, unsharded_views(flat, grad)) if k is not None]
            if pairs:
                record(pairs)

        handles.append(flat_param.register_post_accumulate_grad_hook(on_accumulated))
    return removal_of(handles)


def removal_of(handles: list[Any]) -> Callable[[], None] | None:
    """What removes these hook handles (the hooks on FSDP's flat parameters), None when there are none."""
    if not handles:
        return None

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo

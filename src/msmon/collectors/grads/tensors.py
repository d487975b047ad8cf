"""What the weight-gradient collector checks about a gradient tensor and the hooks on it: its
identity as a row describes it, the version counter it shares, which other hooks may write it."""

from __future__ import annotations

import torch

from ..base import READS_NOTHING


def identity(t: torch.Tensor) -> tuple[int, int, int]:
    # a sparse tensor has no one data pointer (stats.sparse.is_sparse, inline: a call per hook)
    return id(t), t.data_ptr() if t.layout is torch.strided else 0, t._version


def counter_of(grad: torch.Tensor) -> int:
    """The tensor whose version counter `grad` uses: its base when it is a view (views share it)."""
    base = grad._base
    return id(base if base is not None else grad)


def hooks_that_may_write(param: torch.Tensor) -> int:
    """The post-accumulate-grad hooks on `param` (this collector's own among them), but those of
    msmon's that read nothing (collectors.base.READS_NOTHING)."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    count = 0
    for hook in hooks.values():  # a loop, not a generator: one call per gradient hook, not one per hook
        count += not getattr(hook, READS_NOTHING, False)
    return count


def unserializable(hook):
    """Tensor hooks are never pickled with their tensor; this says so to torch, whose pickling
    of a plain tensor would otherwise warn about each of them."""
    hook.__torch_unserializable__ = True
    return hook

"""What the weight-gradient collector checks about a gradient tensor and the hooks on it: the
version counter it shares, which other hooks may write it (its identity as a row describes it:
reduced_rows.identity, beside the rows that reuse it)."""

from __future__ import annotations

import torch

from ..base import READS_NOTHING


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

"""In-place rewrites of `.grad` that leave its version counter where it was, seen without a
change to the script.

The weight-gradient collector takes grad_unreduced's row of a gradient for its grad_reduced row
when the tensor, its data pointer and its version counter are still those the row described
(collectors/grad_tensors.identity: nothing reduced it, as in a single process). torch's
`GradScaler.unscale_` (called by `GradScaler.step` too) divides an optimizer's gradients in place
with a kernel that does not move their version counter
(`_amp_foreach_non_finite_check_and_unscale_`), so the scaled gradient's row would pass for the
unscaled one the optimizer consumes. While at least one listener is registered, `unscale_` of
torch's GradScaler and of its subclasses that define their own (FSDP's ShardedGradScaler) is
wrapped process-wide; once it has run, each listener is told the optimizer whose gradients were
rewritten. The call itself goes on unchanged. When the last listener leaves, the methods are put
back.

A write through `.data` (hand-written clipping, fairseq's `multiply_grads`) has a version counter
of its own and cannot be seen this way (docs/frameworks.md says so).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .grad_scalers import scaler_classes_defining
from .listeners import Listeners, Listening
from .patching import Replacements

#: on_rewritten(optimizer): the gradients of `optimizer`'s parameters were rewritten in place
OnRewritten = Callable[[Any], None]

_registry: Listeners[OnRewritten] = Listeners()


def _wrap_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, optimizer, *args, **kwargs)
        for listener in list(_registry.items):
            listener(optimizer)  # each listener is guarded by its collector: a failure stays msmon's
        return result

    return unscale_


def listen(on_rewritten: OnRewritten) -> Listening:
    """Tell `on_rewritten` of every in-place rewrite of an optimizer's gradients seen from now until `stop()`."""

    def install(replaced: Replacements) -> None:
        for cls in scaler_classes_defining("unscale_"):
            replaced.replace(cls, "unscale_", _wrap_unscale)

    return _registry.add(on_rewritten, install)


def params_of(optimizer: Any) -> set[int]:
    """The ids of the parameters `optimizer` steps (its param_groups'), empty when it has none."""
    groups = getattr(optimizer, "param_groups", None) or []
    return {id(p) for group in groups for p in group.get("params", [])}

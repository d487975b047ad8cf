"""A GradScaler's call to step an optimizer, seen without a change to the script, so that a step
it skips is seen too.

`GradScaler.step(optimizer)` calls `optimizer.step()` only when the scaled gradients were all
finite; otherwise it returns without stepping (the usual first iterations of fp16 training,
while the scale comes down), and `update()` lowers the scale. No hook of the optimizer runs
then, so nothing tells a monitor that the iteration is over: its backward passes would count
as more micro-batches of the next step. While at least one listener is registered,
`GradScaler.step` (torch's, which its subclasses such as FSDP's ShardedGradScaler inherit) is
wrapped process-wide: each listener is told when the call starts and when it has returned,
with the optimizer it was given; a listener tells a skipped step by whether its own optimizer
hook ran in between. The call itself goes on unchanged. When the last listener leaves, the
method is put back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from .grad_scalers import scaler_classes_defining
from .listeners import Listeners, Listening
from .patching import Replacements


@dataclass(frozen=True)
class ScalerStepListener:
    """starting(optimizer) before `GradScaler.step(optimizer)` runs, ended(optimizer) once it
    returned (not when it raised)."""

    starting: Callable[[Any], None]
    ended: Callable[[Any], None]


_registry: Listeners[ScalerStepListener] = Listeners()


def _wrap_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        listeners = list(_registry.items)
        for listener in listeners:
            listener.starting(optimizer)  # each listener is guarded by its owner: a failure stays msmon's
        result = original(self, optimizer, *args, **kwargs)
        for listener in listeners:
            listener.ended(optimizer)
        return result

    return step


def listen(starting: Callable[[Any], None], ended: Callable[[Any], None]) -> Listening:
    """Tell `starting` and `ended` of every `GradScaler.step` call from now until `stop()`."""

    def install(replaced: Replacements) -> None:
        for cls in scaler_classes_defining("step"):
            replaced.replace(cls, "step", _wrap_step)

    return _registry.add(ScalerStepListener(starting, ended), install)

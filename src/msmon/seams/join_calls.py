"""A rank that ran out of inputs inside torch's join context (`DistributedDataParallel.join()`,
`torch.distributed.algorithms.join.Join`), seen without a change to the script.

With uneven inputs, a rank that leaves its loop early waits in `Join.__exit__`, shadowing the
collectives of the ranks still training (DDP's join hook all-reduces zeros for their gradients)
until every rank has left. msmon's own per-step collectives (the `alert.on_nan: "stop"` round,
runtime/nan_stop.py) are shadowed by no join hook: the ranks still training would wait in them
for a rank that takes no step any more. While at least one listener is registered,
`Join.__exit__` is wrapped process-wide: each listener is told `leaving()` when the rank starts
waiting there (the context ends without an exception and is enabled) and `back(done)` once
`__exit__` has returned (`done`: every rank left; False when it raised, as
`throw_on_early_termination` makes it). The call itself goes on unchanged. When the last
listener leaves, the method is put back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from .listeners import Listeners, Listening
from .patching import Replacements


@dataclass(frozen=True)
class JoinListener:
    leaving: Callable[[], None]
    back: Callable[[bool], None]


_registry: Listeners[JoinListener] = Listeners()


def _wrap_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __exit__(self: Any, exc_type: Any, *args: Any, **kwargs: Any) -> Any:
        shadows = exc_type is None and bool(getattr(self, "_enable", True))
        listeners = list(_registry.items) if shadows else []
        for listener in listeners:
            listener.leaving()  # each listener contains its own failures
        done = False
        try:
            result = original(self, exc_type, *args, **kwargs)
            done = True
            return result
        finally:
            for listener in listeners:
                listener.back(done)

    return __exit__


def listen(leaving: Callable[[], None], back: Callable[[bool], None]) -> Listening:
    """Tell `leaving` and `back` of every rank waiting in a join context from now until `stop()`."""

    def install(replaced: Replacements) -> None:
        try:
            from torch.distributed.algorithms.join import Join
        except ImportError:  # a torch built without distributed: no join context
            return
        replaced.replace(Join, "__exit__", _wrap_exit)

    return _registry.add(JoinListener(leaving, back), install)

"""torch.distributed: listeners see the tensors that go through its collectives
(instrumentor.py wraps them; calls.py says what a call is; the comm collector is the listener).

Everything the collector and the tests use is re-exported here, so `hooks.torch_distributed` is
the one name to import.
"""

from __future__ import annotations

from ..core.collective_calls import (
    ALWAYS_ASYNC,
    COLLECTIVES,
    UNKNOWN_SITE,
    CallSite,
    CollectiveCall,
    CollectiveListener,
    find_call_site,
    tensors_of,
)
from ..core.collective_listeners import (
    acquire,
    add_listener,
    deliver_completed,
    instrument,
    is_instrumented,
    release,
    remove_listener,
    uninstrument,
)
from ..core.spec import Framework

__all__ = [
    "ALWAYS_ASYNC",
    "COLLECTIVES",
    "FRAMEWORK",
    "UNKNOWN_SITE",
    "CallSite",
    "CollectiveCall",
    "CollectiveListener",
    "acquire",
    "add_listener",
    "deliver_completed",
    "find_call_site",
    "instrument",
    "is_instrumented",
    "release",
    "remove_listener",
    "tensors_of",
    "uninstrument",
]

FRAMEWORK = Framework(
    name="torch_distributed",
    distribution="torch",
    supported=">=2.1,<2.14",  # pyproject's floor; tested on 2.13
    instrument=instrument,
    uninstrument=uninstrument,
)

"""torch.distributed: the collectives are wrapped for the whole process while the config has
cc_distribution on (instrumentor.py, the launcher's hold). What a call is and the listeners that
see it (the comm collector is one) are the hooks' core: seams/collective_calls.py and
seams/collective_listeners.py.
"""

from __future__ import annotations

from typing import Any

from ...seams.spec import Framework

__all__ = ["FRAMEWORK", "instrument", "uninstrument"]


def instrument(session: Any = None) -> bool:
    """The launcher's hold on the wrappers (instrumentor.py, imported when switched on: this
    `__init__` stays light, as the registry loads it)."""
    from . import instrumentor

    return instrumentor.instrument(session)


def uninstrument() -> None:
    from . import instrumentor

    instrumentor.uninstrument()


FRAMEWORK = Framework(
    name="torch_distributed",
    switched_on_by="torch",
    precedence=100,
    distribution="torch",
    supported=">=2.1,<2.14",  # pyproject's floor; tested on 2.13
    instrument=instrument,
    uninstrument=uninstrument,
)

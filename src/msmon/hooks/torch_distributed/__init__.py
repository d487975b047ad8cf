"""torch.distributed: the collectives are wrapped for the whole process while the config has
cc_distribution on (instrumentor.py, the launcher's hold). What a call is and the listeners that
see it (the comm collector is one) are the hooks' core: seams/collective_calls.py and
seams/collective_listeners.py.
"""

from __future__ import annotations

from ...seams.spec import Framework
from .instrumentor import instrument, uninstrument

__all__ = ["FRAMEWORK", "instrument", "uninstrument"]

FRAMEWORK = Framework(
    name="torch_distributed",
    switched_on_by="torch",
    precedence=100,
    distribution="torch",
    supported=">=2.1,<2.14",  # pyproject's floor; tested on 2.13
    instrument=instrument,
    uninstrument=uninstrument,
)

"""The launcher's hold on the collectives' wrappers: switched on by the hooks registry when torch
is imported, it keeps torch.distributed wrapped for the whole process when the session's config
has cc_distribution on (and leaves torch untouched otherwise). The wrapping and the listeners
are the hooks' core (seams/collective_listeners.py), which each monitor's comm collector
holds too, from attach to detach.
"""

from __future__ import annotations

import threading
from typing import Any

from ...seams.collective_listeners import acquire, release

_session_hold = False
_lock = threading.Lock()


def instrument(session: Any = None) -> bool:
    """The launcher's hold (hooks registry): wrap for the whole process, once, when the
    session's config has cc_distribution on; without a session, unconditionally."""
    global _session_hold
    config = getattr(session, "config", None)
    if config is not None and not config.cc_distribution.enable:
        return False
    with _lock:
        if not _session_hold:
            _session_hold = acquire()
        return _session_hold


def uninstrument() -> None:
    """Drop the launcher's hold; the wrappers go when no monitor holds them either."""
    global _session_hold
    with _lock:
        if _session_hold:
            _session_hold = False
            release()

"""One line per rule and tensor: an alert that fires again is counted, not logged again.

After a NaN every later step alerts again on the same tensors; a rank fed bad batches is named
by the rank-outlier rule at every step; a diverged replica is found again at every check. A line
each time would bury the first one. So every rule (the row rules, the NaN origin, the
rank-outlier rule, the replica check) asks here before it logs: the first alert of a rule on a
tensor (for the rank-outlier rule, on one of the rank's statistics) is logged, its repeats are
counted, and when the monitor closes one line per rule and tensor that fired more than once gives
the count and the steps. One object per monitor, kept across writer restarts, shared by the
writer thread and the exchange threads (a lock). The anomaly dump keeps every alert.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger("msmon")


@dataclass
class Repeats:
    """In how many steps (or checks) one rule alerted on one tensor."""

    rule: str
    tag: str
    count: int
    first_step: int
    last_step: int
    unit: str  # "steps", or "checks" for the replica check
    kept: str  # where every alert is kept


class AlertRepeats:
    """The alerts of one monitor so far, by (rule, tensor)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._seen: dict[tuple, Repeats] = {}
        self._lock = threading.Lock()

    def first(
        self, key: tuple, rule: str, tag: str, step: int, unit: str = "steps", kept: str = "all in the anomaly dump"
    ) -> bool:
        """True when `rule` alerts on `key` for the first time (log it); a later step is counted
        (the same step again, at another micro-step or op, is not)."""
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                self._seen[key] = Repeats(rule, tag, 1, step, step, unit, kept)
                return True
            if seen.last_step != step:
                seen.count += 1
                seen.last_step = step
            return False

    def lines(self) -> list[str]:
        """One line per rule and tensor that alerted more than once."""
        with self._lock:
            seen = list(self._seen.values())
        return [
            f"msmon alert [rank {self.rank}] {r.rule} on {r.tag}: alerted in {r.count} {r.unit}, "
            f"{'steps ' if r.unit != 'steps' else ''}{r.first_step} to {r.last_step} (the first one logged; {r.kept})"
            for r in seen
            if r.count > 1
        ]

    def log_summary(self) -> None:
        """At the monitor's close: the lines, once (later calls say nothing new)."""
        for line in self.lines():
            logger.warning(line)
        with self._lock:
            self._seen.clear()

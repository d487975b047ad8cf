"""What this rank saw, step by step, and which of its readers are still reading a step.

A step's alerts arrive on other threads, after the training thread has moved on: the row rules
and the non-finite origin on the writer thread once the step's copy reached the host, the
rank-outlier rule and the replica check on their exchange threads once the ranks exchanged
their numbers. Each reader says here which steps it was handed (`expect`, before it may
finish them) and when it finished one (`done`), and posts what it found (`saw`). The vote of
a step (step_actions.py) waits, a bounded time, until every reader finished that step on this
rank, then takes what was seen. A reader that is switched off (its exchange failed) is retired:
its steps are no longer waited for. Others may listen to every alert posted, whatever the
actions read (the trackers' verdict: collectors/trackers/verdict.py). Every method is safe from
any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Callable

from ...anomaly.event import NAN_ORIGIN_RULE, REPLICA_RULE
from ...anomaly.seen import Seen

WRITER, RANK_OUTLIER, REPLICA_CHECK = "writer", "rank_outlier", "replica_check"
# what one rank sends for one step at most: the first in training order (what the kind of fault
# reads), and every replica and origin record (few: one per tensor that differs, one origin)
MAX_SEEN_PER_STEP = 256


class ActionBoard:
    """One monitor's readers and alerts; inert (`active` False) when no action is configured."""

    def __init__(self, active: bool = False, rules: set[str] | None = None) -> None:
        self.active = active
        self.rules = rules  # the rules whose alerts an action reads (None: all, for a verdict)
        self.pp_stage = 0
        self._cond = threading.Condition()
        self._pending: dict[str, set[int]] = {}
        self._retired: set[str] = set()
        self._seen: dict[int, list[Seen]] = {}
        self._listeners: list[Callable[[list[Seen]], None]] = []

    def listen(self, hear: Callable[[list[Seen]], None]) -> None:
        """`hear` gets every alert posted from now on (whatever the actions read, and with no
        action configured), on the poster's thread: it must be quick and never raise."""
        self._listeners.append(hear)

    def expect(self, source: str, step: int) -> None:
        """`source` was handed `step` and will say when it finished it."""
        if not self.active:
            return
        with self._cond:
            if source not in self._retired:
                self._pending.setdefault(source, set()).add(step)

    def done(self, source: str, step: int) -> None:
        if not self.active:
            return
        with self._cond:
            self._pending.get(source, set()).discard(step)
            self._cond.notify_all()

    def retire(self, source: str) -> None:
        """`source` finishes nothing more (switched off): stop waiting for it."""
        if not self.active:
            return
        with self._cond:
            self._retired.add(source)
            self._pending.pop(source, None)
            self._cond.notify_all()

    def saw(self, seen: Iterable[Seen]) -> None:
        if not self.active and not self._listeners:
            return
        posted = [replace(one, pp_stage=self.pp_stage) if self.pp_stage and not one.pp_stage else one for one in seen]
        for hear in list(self._listeners):
            hear(posted)
        if not self.active:
            return
        with self._cond:
            for one in posted:
                if self.rules is None or one.rule in self.rules:
                    self._seen.setdefault(one.step, []).append(one)

    def unfinished(self, step: int) -> list[str]:
        """The readers that have not finished every step up to `step`."""
        with self._cond:
            return sorted(source for source, steps in self._pending.items() if any(s <= step for s in steps))

    def wait_finished(self, step: int, seconds: float) -> list[str]:
        """Wait until every reader finished every step up to `step`, at most `seconds`; the
        readers still unfinished then (none: all done)."""
        if not self.active:
            return []
        deadline = time.monotonic() + seconds
        with self._cond:
            while True:
                late = [s for s, steps in self._pending.items() if any(x <= step for x in steps)]
                left = deadline - time.monotonic()
                if not late or left <= 0:
                    return sorted(late)
                self._cond.wait(left)

    def take(self, step: int) -> list[Seen]:
        """Everything seen at `step` and before (a late reader's alerts of an earlier step come
        with it), at most MAX_SEEN_PER_STEP per step, in training order."""
        with self._cond:
            steps = sorted(s for s in self._seen if s <= step)
            taken = [self._seen.pop(s) for s in steps]
        return [one for seen in taken for one in first_of_step(seen)]


def first_of_step(seen: list[Seen]) -> list[Seen]:
    """One step's alerts of one rank in training order, at most MAX_SEEN_PER_STEP of them, and
    every replica and origin record past those (what the kind of fault reads)."""
    ordered = sorted(seen, key=lambda e: e.path_event().position())
    if len(ordered) <= MAX_SEEN_PER_STEP:
        return ordered
    kept = ordered[:MAX_SEEN_PER_STEP]
    return kept + [e for e in ordered[MAX_SEEN_PER_STEP:] if e.rule in (REPLICA_RULE, NAN_ORIGIN_RULE)]

"""The trackers' verdict: the kind of fault, told from what every rank alerted on so far, as
`msmon analyse` tells it from the dump.

Each rank hears its alerts where alert.actions' vote hears them (runtime/actions/board.py: the
writer's rules and non-finite origin, the rank-outlier rule and the replica check on their
exchange threads), with or without actions configured: the rules are not run twice. The kind
(anomaly/fault_kind.py's `classify`) reads the first anomalous step and the replica checks, so a
rank keeps (`RankAlerts`) its alerts up to its own first anomalous step and its earliest replica
check's, at most board.first_of_step's per step in training order, and drops the later ones as
they come (after a NaN every step alerts on every tensor). At its next recorded step they go
with its lanes, encoded (`encode`: the `PathEvent` fields, in JSON), in one more gather to the
logging rank, only when a rank has some (collector.py). The logging rank keeps every rank's
(`FirstAnomaly`) and tells the kind with `classify` over the recording ranks, the function and
the ranks `msmon analyse` uses (the ranks that made a dump folder: every recording rank).
Torch-free.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection, Iterable
from dataclasses import astuple

from ...anomaly.data_path import PathEvent
from ...anomaly.event import REPLICA_RULE
from ...anomaly.fault_kind import FaultKind, classify
from ...anomaly.seen import Seen
from ...runtime.actions.board import first_of_step


class RankAlerts:
    """This rank's alerts that may decide the kind, from their threads until the writer takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Seen] = []
        self._first: int | None = None  # this rank's first anomalous step
        self._first_replica: int | None = None  # and its first replica-check divergence

    def hear(self, seen: list[Seen]) -> None:
        """An ActionBoard listener: on the poster's thread, quick."""
        with self._lock:
            self._pending.extend(one for one in seen if self._decides(one))

    def _decides(self, one: Seen) -> bool:
        """Whether it may be in what classify reads: the global first anomalous step is at most
        this rank's, and a replica check counts from its earliest."""
        keep = False
        if one.rule == REPLICA_RULE and (self._first_replica is None or one.step <= self._first_replica):
            self._first_replica, keep = one.step, True
        if self._first is None or one.step <= self._first:
            self._first, keep = one.step, True
        return keep

    def take(self) -> bytes:
        """What came since the last take, encoded (b"": nothing)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return b""
        by_step: dict[int, list[Seen]] = {}
        for one in pending:
            by_step.setdefault(one.step, []).append(one)
        return encode(one.path_event() for step in sorted(by_step) for one in first_of_step(by_step[step]))


def encode(events: Iterable[PathEvent]) -> bytes:
    return json.dumps([astuple(e) for e in events], separators=(",", ":")).encode()


def decode(raw: bytes) -> list[PathEvent]:
    return [PathEvent(*fields) for fields in json.loads(raw)] if raw else []


class FirstAnomaly:
    """Every rank's alerts that decide the kind, on the logging rank: those of the first
    anomalous step so far, and each rank's earliest replica-check ones."""

    def __init__(self, ranks: Collection[int]) -> None:
        self.ranks = list(ranks)
        self.step: int | None = None
        self.first: list[PathEvent] = []
        self.replicas: dict[int, list[PathEvent]] = {}  # rank -> its replica checks of its earliest step

    def add(self, events: Iterable[PathEvent]) -> bool:
        """Keep what decides the kind; whether anything was kept."""
        kept = False
        for e in events:
            if e.rule == REPLICA_RULE:
                have = self.replicas.get(e.rank)
                if not have or e.step < have[0].step:
                    self.replicas[e.rank], kept = [e], True
                elif e.step == have[0].step:
                    have.append(e)
                    kept = True
            if self.step is None or e.step < self.step:
                self.step, self.first, kept = e.step, [e], True
            elif e.step == self.step:
                self.first.append(e)
                kept = True
        return kept

    def kind(self) -> FaultKind | None:
        later = [e for checks in self.replicas.values() for e in checks if e.step != self.step]
        return classify([*self.first, *later], self.ranks)


def same_kind(a: FaultKind | None, b: FaultKind | None) -> bool:
    """The same verdict for the trackers: code, step, rank(s) and first module (its words aside)."""
    if a is None or b is None:
        return a is b
    return (a.code, a.step, a.rank, a.ranks, a.module) == (b.code, b.step, b.rank, b.ranks, b.module)

"""The ranks' vote: what each monitored rank saw, in one small gather on msmon's own gloo group.

Why here and how. A rank that acts alone (stops, skips its optimizer step, records more)
leaves the others waiting in the training's next collective or makes its replicas differ.
So every monitored rank takes part in the same rounds: in each, one all_gather of two numbers
per rank (its state: FINITE, NONFINITE for on_nan, LEFT; and how many bytes of alerts it
brings), and, only when one of them brings alerts, one more gather of those bytes. Every rank
reads the same answers and computes the same decision from them. The group is msmon's own
(gloo, over the monitored ranks, made at the first round: every monitored rank gets there), so
the gathers never queue behind the training's collectives, and the collectives are torch's
unwrapped ones (cc_distribution never records them).

A bounded wait. A rank that died or hangs never answers: each gather waits at most
`alert.vote_timeout` seconds, then raises VoteFailed with one line; the caller switches the
vote off on this rank and training goes on to the job's own failure path (the launcher ends a
job whose rank died; a hung rank holds the training's next collective, as it would without
msmon). A rank whose peer died meets the failure at once: gloo sees the closed connection.

Uneven inputs. Under DDP's `join()` a rank that ran out of inputs waits in the join context
while the others train on; it takes no more steps, so it would bring nothing to their rounds.
From the moment it waits there (seams/join_calls.py) a thread of that rank answers every round
LEFT (skip_step's before the optimizer step and the one at the step's end alike), until a round
in which every rank is LEFT (all left their loops; the rank's training thread waits for
that round before it goes on, so that the next round is the next one on every rank). A round
that stops the ranks still training (`stopping`) is followed by their closing round, which the
thread answers, then ends.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...seams import join_calls
from ...seams.listeners import Listening
from ...system import exit_drain
from ...system.distributed import several_processes

logger = logging.getLogger("msmon")

FINITE, NONFINITE, LEFT = 0.0, 1.0, 2.0  # a rank's state in a round


class VoteFailed(RuntimeError):
    """A gather of the vote failed or timed out: a rank died or hangs. `what`: which gather;
    `why`: what happened, in words."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} {why}")
        self.what, self.why = what, why


@dataclass
class Round:
    """One round's answers, in the voting ranks' order: (state, bytes) each, and the bytes."""

    answers: list[tuple[float, int]]
    payloads: list[bytes] = field(default_factory=list)

    def ranks_in(self, members: list[int], state: float) -> list[int]:
        return [rank for rank, (value, _) in zip(members, self.answers) if value == state]


def _original(name: str) -> Any:
    function = getattr(dist, name)
    return getattr(function, "__msmon_original__", function)  # not the training's comm, never recorded


class StepVote:
    """The monitored ranks' rounds (module docstring). `ranks`: module_ranks ([] every rank)."""

    def __init__(self, ranks: list[int] | None, timeout: float, name: str = "msmon_vote") -> None:
        self.ranks = ranks
        self.timeout = timedelta(seconds=timeout)
        self.name = name
        self.stopping: Callable[[Round], bool] = lambda r: False  # a round after which the ranks stop
        self._group: Any = None
        self._lock = threading.Lock()  # one round issued at a time, in order (the away thread's and the step's)
        self._away: threading.Thread | None = None
        self._back = False
        self._joins: Listening | None = None

    @property
    def distributed(self) -> bool:
        return several_processes()

    def members(self) -> list[int]:
        """The voting ranks, in order; [0] in a single process."""
        if not self.distributed:
            return [0]
        return sorted(self.ranks) if self.ranks else list(range(dist.get_world_size()))

    def round(self, state: float, mine: bytes = b"") -> Round:
        """This rank's state and alerts (bytes) in the next round; every rank's."""
        with self._lock:
            return self._round(state, mine)

    def all_closed(self) -> None:
        """Wait until every voting rank got here (has closed its monitor): a launcher ends the
        other ranks as soon as one exits, which must not cut a rank's last writes short."""
        if self.distributed:
            self.round(FINITE)

    # -- the gathers ----------------------------------------------------------------------------
    def _round(self, state: float, mine: bytes) -> Round:
        group, members = self._members()
        if len(members) == 1:
            return Round([(state, len(mine))], [mine] if mine else [])
        numbers = torch.tensor([state, float(len(mine))], dtype=torch.float64)
        gathered = [torch.empty_like(numbers) for _ in members]
        self._wait(_original("all_gather")(gathered, numbers, group=group, async_op=True), "the vote")
        answers = [(float(v[0]), int(v[1])) for v in gathered]
        sizes = [size for _, size in answers]
        if not any(sizes):
            return Round(answers)
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        if mine:
            padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        parts = [torch.empty_like(padded) for _ in members]
        self._wait(_original("all_gather")(parts, padded, group=group, async_op=True), "the alerts' exchange")
        return Round(answers, [bytes(t[:size].tolist()) for t, size in zip(parts, sizes)])

    def _wait(self, work: Any, what: str) -> None:
        exit_drain.hold(work)
        started = time.monotonic()
        try:
            work.wait(self.timeout)
        except Exception as exc:
            seconds = self.timeout.total_seconds()
            waited = time.monotonic() - started
            why = (
                f"got no answer from every rank within {seconds:g} s (alert.vote_timeout): a rank hangs or died"
                if waited >= 0.9 * seconds
                else f"lost a rank after {waited:.1f} s (its connection closed: it died or left)"
            )
            raise VoteFailed(what, f"{why} ({' '.join(str(exc).split())[:160]})") from None

    def _members(self) -> tuple[Any, list[int]]:
        members = self.members()
        if self._group is None and len(members) > 1:
            options: dict[str, Any] = {"backend": "gloo", "timeout": self.timeout, "use_local_synchronization": True}
            if "group_desc" in inspect.signature(dist.new_group).parameters:  # torch >= 2.3
                options["group_desc"] = self.name
            self._group = dist.new_group(members, **options)
            exit_drain.at_drain(self._release)
        return self._group, members

    def _release(self) -> None:
        if self._group is not None:
            exit_drain.destroy_group(self._group)
            self._group = None

    # -- a rank waiting in a join context -------------------------------------------------------
    def follow_joins(self) -> None:
        """Follow join contexts from now on (the monitor is hooked to its optimizer)."""
        if self._joins is None:
            self._joins = join_calls.listen(self._leaving, self._came_back)

    def stop_listening(self) -> None:
        if self._joins is not None:
            self._joins.stop()
            self._joins = None

    def _leaving(self) -> None:
        """This rank ran out of inputs and waits in a join context: until every rank has, its
        state in each round is LEFT, given by a thread (module docstring)."""
        try:
            if not self.distributed or self._away is not None:
                return
            _, members = self._members()  # on the training thread: the group exists before the thread gathers
            if len(members) == 1:
                return
            self._back = False
            self._away = threading.Thread(target=self._answer_while_away, name="msmon-vote-join", daemon=True)
            self._away.start()
        except Exception as exc:  # the join context goes on whatever happens here
            logger.warning("msmon: following a join context for the ranks' vote failed: %r", exc)

    def _came_back(self, every_rank_left: bool) -> None:
        """The join context returned. When every rank left, the away thread ends with the round
        in which all of them were LEFT: wait for it. When it raised (throw_on_early_termination),
        the thread issues no more rounds."""
        away = self._away
        if away is None:
            return
        if every_rank_left:
            away.join()
        else:
            with self._lock:
                self._back = True
        self._away = None

    def _answer_while_away(self) -> None:
        stopping = False
        try:
            while True:
                with self._lock:
                    if self._back:
                        return
                    answered = self._round(LEFT, b"")
                if all(state == LEFT for state, _ in answered.answers) or stopping:
                    return
                stopping = self.stopping(answered)  # the ranks still training stop: their closing round is next
        except Exception as exc:  # a rank that stopped and is gone: nothing left to answer
            logger.debug("msmon: the vote's rounds of a rank in a join context ended: %r", exc)

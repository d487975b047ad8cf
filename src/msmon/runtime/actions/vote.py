"""The ranks' vote: what each monitored rank saw, in one small gather on msmon's own gloo group.

Why here and how. A rank that acts alone (stops, skips its optimizer step, records more)
leaves the others waiting in the training's next collective or makes its replicas differ.
So every monitored rank gives a few numbers to one all_gather per step (`numbers`), and, only
when one of them saw an alert, the alerts themselves in one more gather of bytes
(`payloads`); every rank reads the same answers and computes the same decision from them. The
group is msmon's own (gloo, over the monitored ranks, made at the first vote: every monitored
rank gets there), so the gathers never queue behind the training's collectives, and the
collectives are torch's unwrapped ones (cc_distribution never records them).

A bounded wait. A rank that died or hangs never answers: each gather waits at most
`alert.vote_timeout` seconds, then raises VoteFailed with one line; the caller switches the
vote off on this rank and training goes on to the job's own failure path (the launcher ends a
job whose rank died; a hung rank holds the training's next collective, as it would without
msmon). A rank whose peer died meets the failure at once: gloo sees the closed connection.
"""

from __future__ import annotations

import inspect
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...system import exit_drain
from ...system.distributed import several_processes

logger = logging.getLogger("msmon")


class VoteFailed(RuntimeError):
    """A gather of the vote failed or timed out: a rank died or hangs."""


def _original(name: str) -> Any:
    function = getattr(dist, name)
    return getattr(function, "__msmon_original__", function)  # not the training's comm, never recorded


class StepVote:
    """The monitored ranks' gathers (module docstring). `ranks`: module_ranks ([] every rank)."""

    def __init__(self, ranks: list[int] | None, timeout: float, name: str = "msmon_vote") -> None:
        self.ranks = ranks
        self.timeout = timedelta(seconds=timeout)
        self.name = name
        self._group: Any = None

    @property
    def distributed(self) -> bool:
        return several_processes()

    def members(self) -> list[int]:
        """The voting ranks, in order; [0] in a single process."""
        if not self.distributed:
            return [0]
        return sorted(self.ranks) if self.ranks else list(range(dist.get_world_size()))

    def numbers(self, values: list[float]) -> list[list[float]]:
        """Every voting rank's `values` (the same length on every rank), in `members()` order."""
        group, members = self._members()
        if len(members) == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in members]
        self._wait(_original("all_gather")(gathered, mine, group=group, async_op=True), "the vote")
        return [v.tolist() for v in gathered]

    def payloads(self, mine: bytes, sizes: list[int]) -> list[bytes]:
        """Every voting rank's bytes, given every rank's size (from a `numbers` gather)."""
        group, members = self._members()
        if len(members) == 1:
            return [mine]
        width = max(sizes)
        padded = torch.zeros(width, dtype=torch.uint8)
        if mine:
            padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        gathered = [torch.empty_like(padded) for _ in members]
        self._wait(_original("all_gather")(gathered, padded, group=group, async_op=True), "the alerts' exchange")
        return [bytes(t[:size].tolist()) for t, size in zip(gathered, sizes)]

    def all_closed(self) -> None:
        """Wait until every voting rank got here (has closed its monitor): a launcher ends the
        other ranks as soon as one exits, which must not cut a rank's last writes short."""
        if self.distributed:
            self.numbers([0.0])

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
            raise VoteFailed(f"{what} {why} ({' '.join(str(exc).split())[:160]})") from None

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

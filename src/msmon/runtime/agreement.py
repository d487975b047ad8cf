"""Ranks that combine sharded statistics switch to an edited config at the same step.

Why. Statistics of tensors split across ranks (ZeRO partitions, Megatron's distributed
optimizer) are combined by one all_gather per shard group at the end of every recorded step
(runtime/shards.py). Which steps are recorded, and how long each gathered payload is,
follow from the config, so every rank of a group must use the same config at every step, or
one rank enters a gather alone (and meets the framework's next collective there) or with a
payload of another length. Ranks read an edited file at different steps: each polls its own
file's mtime, and file systems show an edit to different nodes at different times.

How. Every step is a round in which each rank contributes one number: the hash of the valid
edit it has read and not applied yet, or 0. On a recorded step the number is the first element
of the shard gather's payload (no collective of its own); on other steps it travels in a
one-number all_gather on each shard group, started without waiting for it. A round is read at
the end of the next step (so neither the host nor the device waits for it), and when every
rank of the group gave the same non-zero hash, each rank applies its config with that hash
there. Every rank reads the same numbers at the same step, so every rank decides alike, at
the same step; and the collectives stay in step, since which steps gather and what they carry
depend only on the step and the config in force. The round in flight when a config is applied
is set aside: an edit is applied once. An edit is a proposal, not only a new content: saving
the same file again while `dynamic_on` is true starts another collection, as msprobe does.

A monitor whose statistics are split across several groups agrees on the largest when it
holds every member of the others (expert data-parallel groups inside the data-parallel one);
groups that do not nest cannot agree on one step, so such a rank contributes 0 and keeps its
config (logged once). Without shard groups msmon issues no collective: an edit applies at the
end of the step in which the rank reads it, as it always did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..config import MonitorConfig
from ..system import exit_drain
from .transfer import copy_to_host

if TYPE_CHECKING:
    from .shards import ShardCombiner

logger = logging.getLogger("msmon")

HASH_BITS = 52  # an integer below 2**53 travels exactly as a float64, the shard payload's dtype


def config_hash(cfg: MonitorConfig) -> int:
    """A stable hash, in [1, 2**52), of what the config makes the monitor do: equal on every
    rank for equal settings, whatever the file's layout (key order, spacing, JSON or YAML)."""
    settings = dataclasses.asdict(cfg)
    settings.pop("raw", None)
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return digest % ((1 << HASH_BITS) - 1) + 1


def choose_domain(members: Sequence[Sequence[int]]) -> int | None:
    """The index of the group (given as its members' ranks) that holds every other group's
    members, the first of the largest; None when the groups do not nest."""
    if not members:
        return None
    best = max(range(len(members)), key=lambda i: len(set(members[i])))
    outer = set(members[best])
    return best if all(set(m) <= outer for m in members) else None


def decision(values: Sequence[float]) -> int | None:
    """The hash every rank proposed in a round, or None (someone proposed another, or nothing)."""
    if not values or values[0] <= 0 or any(v != values[0] for v in values):
        return None
    return int(values[0])


@dataclass
class _Round:
    """One step's numbers, on their way to the host."""

    proposal: tuple[int, MonitorConfig] | None  # what this rank proposed in it
    values: Any = None  # the domain group's numbers: a host tensor, or gather outputs
    works: list[Any] = field(default_factory=list)  # gloo gathers to wait for
    events: list[Any] = field(default_factory=list)  # device-to-host copies to wait for
    set_aside: bool = False

    def read(self) -> list[float]:
        for work in self.works:
            work.wait()
        for event in self.events:
            event.synchronize()
        if self.values is None:
            return []
        values = torch.cat(self.values) if isinstance(self.values, list) else self.values
        return [float(v) for v in values.reshape(-1).tolist()]


class ConfigAgreement:
    """One monitor's rounds; see the module docstring. Groups of one rank are left out."""

    def __init__(self, groups: Sequence[Any] = (), rank: int = 0, device: torch.device | None = None) -> None:
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.groups = [g for g in groups if _size(g) > 1]
        members = [list(dist.get_process_group_ranks(g)) for g in self.groups]
        self.domain = choose_domain(members)
        self.domain_ranks = members[self.domain] if self.domain is not None else []
        self.pending: tuple[int, MonitorConfig] | None = None
        self._snapshot: Any = _UNSET
        self._rounds: list[_Round] = []
        self._logged: set[Any] = set()

    @property
    def sharded(self) -> bool:
        """Whether edits wait for the other ranks (False: applied where they are read)."""
        return bool(self.groups)

    def propose(self, cfg: MonitorConfig) -> None:
        """A valid edit this rank has read; it replaces an earlier one not yet applied."""
        if self.sharded and self.domain is None:
            self._log_once(
                "nest",
                "msmon[rank %d]: the edited config is ignored: this rank's sharded statistics are "
                "combined over process groups that do not nest, so the ranks cannot agree on a step to "
                "switch at; restart the job to change the config",
                self.rank,
            )
            return
        self.pending = (config_hash(cfg), cfg)

    def stamp(self) -> float:
        """This rank's number in this step's round, fixed at its first use in the step."""
        if self._snapshot is _UNSET:
            self._snapshot = self.pending
        return float(self._snapshot[0]) if self._snapshot else 0.0

    def end_round(self, stamped: dict[int, torch.Tensor]) -> None:
        """Complete this step's round: `stamped` holds, by id(group), the numbers the shard
        gathers carried; every other group gets a one-number all_gather, not waited for."""
        if not self.sharded:
            return
        value = self.stamp()
        current = _Round(self._snapshot)
        self._snapshot = _UNSET
        for index, group in enumerate(self.groups):
            gathered = stamped.get(id(group))
            if gathered is not None:
                values, events = copy_to_host(gathered)
                current.events.extend(events)
            else:
                values = self._gather(value, group, current)
            if index == self.domain:
                current.values = values
        self._rounds.append(current)

    def decide(self) -> MonitorConfig | None:
        """The config to apply now, at this step's end, or None. Sharded: from the round of
        the previous step, so every rank decides alike; otherwise the edit just read."""
        if not self.sharded:
            pending, self.pending = self.pending, None
            return pending[1] if pending else None
        if len(self._rounds) < 2:
            return None
        oldest = self._rounds.pop(0)
        values = oldest.read()
        if oldest.set_aside or self.domain is None:
            return None
        agreed = decision(values)
        proposal = oldest.proposal
        if agreed is None or proposal is None or proposal[0] != agreed:
            if proposal is not None and values:
                behind = [r for r, v in zip(self.domain_ranks, values) if v != proposal[0]]
                self._log_once(
                    proposal[0],
                    "msmon[rank %d]: the edited config waits for ranks %s, which have not "
                    "read it yet (or found it invalid)",
                    self.rank,
                    behind,
                    level=logging.INFO,
                )
            return None
        if self.pending is not None and self.pending[0] == agreed:
            self.pending = None
        for later in self._rounds:
            later.set_aside = True
        return proposal[1]

    def _gather(self, value: float, group: Any, into: _Round) -> Any:
        device = _device_for(group, self.device)
        mine = torch.full((1,), value, dtype=torch.float64, device=device)  # a fill: no host-to-device copy
        parts = [torch.empty_like(mine) for _ in range(_size(group))]
        work = exit_drain.hold(dist.all_gather(parts, mine, group=group, async_op=True))  # waited at exit at the latest
        if device.type == "cpu":
            into.works.append(work)
            return parts
        work.wait()  # on an accelerator: the copy below waits for the gather, the host does not
        values, events = copy_to_host(torch.cat(parts))
        into.events.extend(events)
        return values

    def _log_once(self, key: Any, message: str, *args: Any, level: int = logging.WARNING) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.log(level, message, *args)


_UNSET = object()


def _size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    try:
        return dist.get_world_size(group)
    except Exception:  # not a member
        return 1


def _device_for(group: Any, fallback: torch.device) -> torch.device:
    """Where a tensor for `group`'s backend lives: the host for gloo, the current GPU for nccl."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def for_shards(combiner: ShardCombiner, adapter: Any, rank: int) -> ConfigAgreement:
    """The agreement of an attached monitor, given its ShardCombiner and optimizer adapter:
    over its shard groups when it combines sharded statistics, else local. The shard gathers
    carry its number from then on."""
    groups = adapter.shard_groups() if combiner.enabled else []
    params = adapter.params()
    agreement = ConfigAgreement(groups, rank, params[0].device if params else None)
    combiner.stamp = agreement.stamp if agreement.sharded else None
    return agreement

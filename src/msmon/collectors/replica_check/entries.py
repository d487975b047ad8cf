"""What the replica check compares: one fingerprinted tensor (an Entry), the tensors
replica_check.json lists as checked or skipped, and how ranks and fingerprints are written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

NO_GRAD = -(1 << 63)  # the fingerprint slot of a parameter without a gradient on this rank
WEIGHT, GRAD = "param_updated", "grad_reduced"
WHAT = {WEIGHT: "weight after the update", GRAD: "reduced gradient before the update"}


@dataclass(frozen=True)
class Entry:
    """One fingerprinted tensor: its name, model chunk and what it is (a `category`)."""

    name: str
    vpp_stage: int
    category: str
    shard: bool = False  # this rank's piece of a parameter split across ranks (HSDP), not the whole

    @property
    def label(self) -> str:
        """The name, with its model chunk when that is not the first (`1:fc1.weight`)."""
        return f"{self.vpp_stage}:{self.name}" if self.vpp_stage else self.name

    @property
    def what(self) -> str:
        """What was compared, for the alert: `weight after the update`, `this rank's shard; ...`."""
        return f"this rank's shard; {WHAT[self.category]}" if self.shard else WHAT[self.category]


class _Tensor(TypedDict):
    name: str
    vpp_stage: int
    category: str


class CheckedTensor(_Tensor, total=False):
    """A tensor the check fingerprints, as replica_check.json lists it (`shard`: true for this
    rank's piece of a split parameter, compared across the ranks holding the same piece)."""

    shard: bool


class SkippedTensor(CheckedTensor):
    """A tensor left out, and why it is not a replica."""

    why: str


def checked(entry: Entry) -> CheckedTensor:
    """`entry` as replica_check.json lists it."""
    out: CheckedTensor = {"name": entry.name, "vpp_stage": entry.vpp_stage, "category": entry.category}
    if entry.shard:
        out["shard"] = True
    return out


def hex64(value: int) -> str:
    """A fingerprint as 16 hex digits (its 64 bits, unsigned)."""
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"


def ranks_text(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0, 1` (the first eight, then how many more), for log lines and alerts."""
    shown = ", ".join(str(r) for r in sorted(ranks)[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"

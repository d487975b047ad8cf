"""What kind of fault the first anomaly is, told from the records of every rank.

- one rank's data: the first anomaly is an AnomalyRankOutlier record (that rank's rank-local
  statistics, its activations, loss or gradient, left the other ranks' spread) and no replica
  check found that rank's replicated weights differing: its copy of the model agrees, so what
  differs is what it was fed. Without replica_check the weights are not checked; the verdict
  says so.
- one rank's copy of the model: the first anomaly is a replica-check divergence, or an
  outlier whose rank the replica check names (a flipped bit in a weight shows first in the
  statistics it feeds, and at the next check in the weights themselves).
- all ranks together: every rank of the job has an anomaly at the first anomaly's step (the
  model or its optimizer turned, not one rank). The job's ranks are those with a folder under
  the dump directory (every rank with the dump on makes one at start) or a record.
Anything else (one rank's non-finite value, say) is not told apart: no kind.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any

from ...anomaly.event import RANK_OUTLIER_RULE, REPLICA_RULE
from .events import AnomalyEvent

ONE_RANK_DATA = "one rank's data"
ONE_RANK_MODEL = "one rank's copy of the model"
ALL_RANKS = "all ranks together"
CODES = {ONE_RANK_DATA: "one_rank_data", ONE_RANK_MODEL: "one_rank_model_copy", ALL_RANKS: "all_ranks"}


@dataclass(frozen=True)
class FaultKind:
    """The kind in words (`kind`) and as a code, where and why."""

    kind: str
    step: int
    rank: int | None  # the one rank, for the one-rank kinds
    why: str

    @property
    def code(self) -> str:
        return CODES[self.kind]

    def sentence(self) -> str:
        return f"Kind: {self.kind}: {self.why}."

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "code": self.code}


def dump_ranks(directory: str) -> set[int]:
    """The ranks with a `rank{r}` folder anywhere under the dump directory."""
    found = set()
    for _root, dirs, _files in os.walk(directory):
        for name in dirs:
            match = re.fullmatch(r"rank(\d+)", name)
            if match:
                found.add(int(match[1]))
    return found


def fault_kind(ordered: list[AnomalyEvent], job_ranks: set[int] | None = None) -> FaultKind | None:
    """The kind of the first of `ordered` (in training order), or None when it is not told."""
    if not ordered:
        return None
    first = ordered[0]
    diverged = sorted({e.rank for e in ordered if e.rule == REPLICA_RULE})
    if first.rule == REPLICA_RULE:
        return FaultKind(
            ONE_RANK_MODEL,
            first.step,
            first.rank,
            f"the replica check found rank {first.rank}'s replicated weights differing from the other ranks' "
            f"at step {first.step}",
        )
    if first.rule == RANK_OUTLIER_RULE:
        if first.rank in diverged:
            check = next(e for e in ordered if e.rule == REPLICA_RULE and e.rank == first.rank)
            return FaultKind(
                ONE_RANK_MODEL,
                first.step,
                first.rank,
                f"rank {first.rank}'s statistics left the other ranks' at step {first.step}, and the replica check "
                f"found its replicated weights differing at step {check.step}",
            )
        return FaultKind(
            ONE_RANK_DATA,
            first.step,
            first.rank,
            f"rank {first.rank}'s rank-local statistics left the other ranks' spread at step {first.step} while "
            "its replicated weights agree (no replica-check divergence names it; with replica_check off they are "
            f"not checked): look at the batches rank {first.rank} read",
        )
    ranks = set(job_ranks or ()) | {e.rank for e in ordered}
    at_first = {e.rank for e in ordered if e.step == first.step}
    if len(ranks) > 1 and ranks <= at_first:
        return FaultKind(
            ALL_RANKS,
            first.step,
            None,
            f"every rank ({len(ranks)}) has an anomaly at step {first.step}: the model or its optimizer turned, "
            "not one rank",
        )
    return None

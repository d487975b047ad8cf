"""What kind of fault the first anomaly is, told from the records of every rank: a reader over
anomaly/fault_kind.py, which tells it from where each rank's anomalies arose on the data path
(the same function a run-time decision calls). The job's ranks are those with a `rank{r}` folder
under the dump directory (every rank with the dump on makes one at start) or a record."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from ...anomaly.fault_kind import KINDS, FaultKind, classify
from .events import AnomalyEvent

__all__ = ["CODES", "FaultKind", "dump_ranks", "fault_kind"]

CODES = {kind.words: code for code, kind in KINDS.items()}  # the kind in words -> its code


def dump_ranks(directory: str) -> set[int]:
    """The ranks with a `rank{r}` folder anywhere under the dump directory."""
    found = set()
    for _root, dirs, _files in os.walk(directory):
        for name in dirs:
            match = re.fullmatch(r"rank(\d+)", name)
            if match:
                found.add(int(match[1]))
    return found


def fault_kind(events: Iterable[AnomalyEvent], job_ranks: set[int] | None = None) -> FaultKind | None:
    """The kind of the first anomalous step of `events`, or None when it is not told."""
    return classify((e.path_event() for e in events), job_ranks)

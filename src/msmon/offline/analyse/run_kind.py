"""The kind of fault of one run, for the line `msmon run` prints when the job ends: the same
reading as `msmon analyse` (kind.py over anomaly/fault_kind.py), bounded.

After a NaN every later step alerts again on every tensor, so a dump can hold millions of
records when the job ends; the kind needs only the first anomalous step (and the replica
checks, whenever they ran). So each rank's file is read line by line: lines of another run are
skipped unparsed (the run id is a plain substring of the line), and past a few steps after the
file's first record only ReplicaMismatch lines are parsed. Records are appended in step order
per rank, up to the background threads' records (rank outlier, replica check) that may come a
step or two after the writer's: hence the margin."""

from __future__ import annotations

import json

from ...anomaly.event import REPLICA_RULE
from .events import AnomalyEvent
from .kind import FaultKind, dump_ranks, fault_kind
from .reading import event_from_record, find_dump_files

STEP_MARGIN = 3  # steps past a file's first record still read in full
_ERRORS = (ValueError, TypeError, KeyError, AttributeError)


def run_fault_kind(directory: str, run_id: str | None) -> FaultKind | None:
    """The kind of run `run_id`'s first anomalous step (every run's records when None), from the
    dump under `directory`; None when there is none or it tells no kind."""
    events: list[AnomalyEvent] = []
    for path in find_dump_files(directory):
        if path.endswith(".jsonl"):
            events += _first_steps(path, run_id)
    return fault_kind(events, dump_ranks(directory)) if events else None


def _first_steps(path: str, run_id: str | None) -> list[AnomalyEvent]:
    mark = None if run_id is None else json.dumps({"run_id": run_id})[1:-1]  # `"run_id": "<id>"`
    replica = f'"rule": "{REPLICA_RULE}"'
    found: list[AnomalyEvent] = []
    first: int | None = None
    late = False  # past the margin: only replica checks are read
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if (mark is not None and mark not in line) or (late and replica not in line):
                    continue
                try:
                    event = event_from_record(json.loads(line), path)
                except _ERRORS:  # a torn line: msmon analyse reports it, the summary line does not
                    continue
                first = event.step if first is None else min(first, event.step)
                if event.step > first + STEP_MARGIN:
                    late = True
                    if event.rule != REPLICA_RULE:
                        continue
                found.append(event)
    except OSError:
        return []
    return found

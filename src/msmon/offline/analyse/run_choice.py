"""Which run `msmon analyse` reads: the anomaly dump (`anomaly_detected/rank<r>/anomaly.jsonl`) is
shared by every run written to one output directory, and each record names its run (`run_id`,
records/runs.py). The newest run is the one whose rank directories, beside the dump, started last;
a dump copied away from its rank directories falls back on the newest run id in its records
(ids sort by start time)."""

from __future__ import annotations

import os

from ...output.resume import rank_dirs
from ...records.runs import ALL_RUNS, Run, RunChoiceError, choice_lines, choose_run, group_runs, of_run
from .events import AnomalyEvent


def runs_beside(directory: str) -> list[Run]:
    """The runs of the rank directories in `directory` (an output directory) or in the one
    holding it (`directory` is its anomaly_detected)."""
    for base in (directory, os.path.dirname(os.path.abspath(directory))):
        found = {d: rank for rank, dirs in rank_dirs(base).items() for d in dirs}
        if found:
            return group_runs(found)
    return []


def of_chosen_run(
    events: list[AnomalyEvent], directory: str, wanted: str | None
) -> tuple[list[AnomalyEvent], str | None, list[str]]:
    """(the events of the run to read, its id or None for every event, the lines that name it
    and the others). RunChoiceError for a --run that names no run or several."""
    if wanted == ALL_RUNS:
        return events, None, []
    runs = runs_beside(directory)
    if runs:
        chosen, others = choose_run(runs, wanted)
        return (
            [e for e in events if of_run(e.run_id, chosen)],
            chosen.run_id if chosen else None,
            (choice_lines(chosen, others, "analyse")),
        )
    ids = sorted({e.run_id for e in events if e.run_id})
    if not ids:
        return events, None, []
    if wanted is None:
        chosen_id = ids[-1]
    else:
        matches = [i for i in ids if i == wanted] or [i for i in ids if i.startswith(wanted)]
        if len(matches) != 1:
            raise RunChoiceError(f"--run {wanted}: {len(matches) or 'no'} run(s) with that id in the dump: {ids}")
        chosen_id = matches[0]
    other_ids = [i for i in ids if i != chosen_id]
    lines = [f"msmon analyse: run {chosen_id}"]
    if other_ids:
        lines.append(
            f"msmon analyse: the dump holds {len(other_ids)} other run(s) (--run ID, or --run all): "
            f"{', '.join(other_ids)}"
        )
    return [e for e in events if e.run_id == chosen_id], chosen_id, lines

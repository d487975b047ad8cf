"""Which run `msmon analyse` reads: the anomaly dump (`anomaly_detected/rank<r>/anomaly.jsonl`) is
shared by every run written to one output directory, and each record names its run (`run_id`,
records/runs.py). The newest run is the one whose rank directories, beside the dump, started
last; a dump copied away from its rank directories falls back on the newest run id in its records
(ids sort by start time).

The records name their run even where the rank directories cannot: a run whose run.json files
are damaged (a torn write, a hand edit) or whose directories were removed still has its records,
and when its id is newer than the newest run of the directories, that is the run read, and the
reader says why the directories did not name it. The choice is made before anything else is
read, so that a `--run` naming no run is an error (exit 2, the runs listed) even where the dump
holds no record at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ...output.resume import rank_dirs
from ...records.runs import (
    ALL_RUNS,
    NO_RUN,
    Run,
    RunChoiceError,
    choice_lines,
    choose_run,
    damaged_lines,
    group_runs,
    of_run,
)
from .events import AnomalyEvent


@dataclass
class RunPick:
    """The run analyse reads: its id (None: every record), the lines that name it and the others."""

    run_id: str | None
    lines: list[str] = field(default_factory=list)
    chosen: Run | None = None  # the rank directories' run, when the id is one of theirs

    def keeps(self, event: AnomalyEvent) -> bool:
        if self.chosen is not None:
            return of_run(event.run_id, self.chosen)
        return self.run_id is None or event.run_id == self.run_id


def runs_beside(directory: str) -> list[Run]:
    """The runs of the rank directories in `directory` (an output directory) or in the one
    holding it (`directory` is its anomaly_detected)."""
    for base in (directory, os.path.dirname(os.path.abspath(directory))):
        found = {d: rank for rank, dirs in rank_dirs(base).items() for d in dirs}
        if found:
            return group_runs(found)
    return []


def pick_run(events: list[AnomalyEvent], directory: str, wanted: str | None) -> RunPick:
    """The run to read (module docstring). RunChoiceError for a --run that names no run or several."""
    if wanted == ALL_RUNS:
        return RunPick(None)
    runs = runs_beside(directory)
    known = {r.run_id for r in runs}
    orphans = sorted({e.run_id for e in events if e.run_id and e.run_id not in known})  # records of no directory
    if wanted is not None:
        by_dirs = [r.run_id for r in runs]
        matches = [i for i in [*by_dirs, *orphans] if i == wanted] or [
            i for i in [*by_dirs, *orphans] if i.startswith(wanted)
        ]
        if len(matches) != 1:
            listed = [r.line() for r in reversed(runs)] + [f"{i}  (in the dump's records only)" for i in orphans]
            what = "no run" if not matches else f"{len(matches)} runs"
            raise RunChoiceError(
                f"--run {wanted}: {what} with that id; the runs here are:\n"
                + ("\n".join("  " + line for line in listed) if listed else "  (none: no run ids here)")
            )
        wanted = matches[0]
        if wanted in orphans:
            return _orphan(wanted, runs, orphans)
        chosen, others = choose_run(runs, wanted)
        return RunPick(wanted, choice_lines(chosen, others, "analyse"), chosen)
    if runs:
        chosen, others = choose_run(runs, None)
        newer = [i for i in orphans if chosen is None or chosen.run_id == NO_RUN or i > chosen.run_id]
        if newer:
            return _orphan(newer[-1], runs, orphans)
        lines = choice_lines(chosen, others, "analyse")
        if orphans:
            lines.append(f"msmon analyse: the dump also holds records of {', '.join(orphans)} (--run ID)")
        return RunPick(chosen.run_id if chosen else None, lines, chosen)
    if not orphans:
        return RunPick(None)
    return _orphan(orphans[-1], runs, orphans)


def _orphan(run_id: str, runs: list[Run], orphans: list[str]) -> RunPick:
    """A run named by the dump's records alone: read them, and say why no rank directory named it."""
    others = [i for i in orphans if i != run_id]
    lines = [f"msmon analyse: run {run_id}, named by the anomaly dump's records" + _why_unnamed(runs)]
    lines += damaged_lines(runs, None, "analyse")
    if runs or others:
        lines.append(
            f"msmon analyse: {len(runs) + len(others)} other run(s) here (choose one with --run ID, or --run all):"
        )
        lines += ["  " + r.line() for r in reversed(runs)] + [f"  {i}  (in the dump's records only)" for i in others]
    return RunPick(run_id, lines)


def _why_unnamed(runs: list[Run]) -> str:
    if not runs:
        return " (no rank directory beside the dump)"
    if any(r.damaged for r in runs):
        return "; no rank directory's run.json names it (damaged ones are listed below)"
    return "; no rank directory here names it (removed, or moved elsewhere?)"


def of_chosen_run(
    events: list[AnomalyEvent], directory: str, wanted: str | None
) -> tuple[list[AnomalyEvent], str | None, list[str]]:
    """(the events of the run to read, its id or None for every event, the lines that name it
    and the others). RunChoiceError for a --run that names no run or several."""
    pick = pick_run(events, directory, wanted)
    return [e for e in events if pick.keeps(e)], pick.run_id, pick.lines

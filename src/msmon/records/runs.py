"""Runs kept apart: every `msmon run` has a run id, and each rank directory says which runs wrote it.

Several jobs often write to one output directory (a rerun, a restart, `msmon struct` before the
real job). msprobe's layout, `<time>-rank<r>-<uid>` per rank, has no notion of a run, and a
rank directory's time prefix differs between the ranks of one job. So the launcher draws one
run id per job (`new_run_id`, passed to every rank in MSMON_RUN_ID) and each rank writes
`run.json` into its directory, beside msprobe's files, which leaves the layout as msprobe reads
it. The anomaly dump, shared by all runs (`anomaly_detected/rank<r>/anomaly.jsonl`), carries the
run id in each record (`run_id`). A directory continued by `append_output` lists every run that
wrote in it. Without the launcher (the API alone) a run id is taken from MSMON_RUN_ID when the
job sets it; otherwise a rank directory has no run.json and belongs to no run.

The readers (`msmon db`, `report`, `convert`) group rank directories by run (`group_runs`),
take the newest unless `--run` names another (`choose_run`), and list the others. Torch-free.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from .layout import RUN_FILE

ENV_RUN_ID = "MSMON_RUN_ID"  # set by the launcher in every process of a job
NO_RUN = "unlabelled"  # the group of rank directories without run.json (msprobe's, older msmon's)
ALL_RUNS = "all"  # `--run all`: every run together, as before runs were kept apart


def new_run_id() -> str:
    """`20261206-031500-1a2b3c`: sorts by start time, unique among jobs started the same second."""
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def current_run_id() -> str | None:
    return os.environ.get(ENV_RUN_ID) or None


def write_run_file(rank_dir: str, run_id: str, rank: int) -> None:
    """Add `run_id` to the runs that wrote in `rank_dir` (its run.json); the first is the one that
    created it. An OSError is the caller's (the rank's output stops, as for any write)."""
    path = os.path.join(rank_dir, RUN_FILE)
    data = _read(path)[0] or {"rank": rank, "runs": []}
    if any(r.get("run_id") == run_id for r in data["runs"]):
        return
    data["runs"].append({"run_id": run_id, "started": datetime.now().isoformat(timespec="seconds")})
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def _read(path: str) -> tuple[dict | None, str | None]:
    """(run.json's content, None) or (None, why it cannot be read: None when there is none)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    except ValueError as exc:
        return None, f"not valid JSON ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        return None, 'no list of "runs"'
    data["runs"] = [r for r in data["runs"] if isinstance(r, dict) and isinstance(r.get("run_id"), str)]
    if not data["runs"]:
        return None, "names no run"
    return data, None


def runs_of(rank_dir: str) -> list[tuple[str, str]]:
    """[(run id, start time)] of the runs that wrote in `rank_dir`; [] without run.json."""
    data = _read(os.path.join(rank_dir, RUN_FILE))[0]
    return [(r["run_id"], str(r.get("started", ""))) for r in data["runs"]] if data else []


def run_file_problem(rank_dir: str) -> str | None:
    """Why `rank_dir`'s run.json, which exists, names no run (a torn write, a hand edit); None
    when it is fine or absent."""
    return _read(os.path.join(rank_dir, RUN_FILE))[1]


@dataclass
class Run:
    """One run's rank directories."""

    run_id: str  # NO_RUN for the directories without run.json
    started: str  # ISO time; for NO_RUN the newest directory's modification time
    dirs: list[str] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)
    damaged: dict[str, str] = field(default_factory=dict)  # NO_RUN's directories whose run.json is damaged: why

    def line(self) -> str:
        """One line of the run list: id, start, ranks, where."""
        when = self.started.replace("T", " ") if self.started else "?"
        ranks = len(self.ranks) or len(self.dirs)
        return f"{self.run_id}  started {when}, {ranks} rank{'s' if ranks != 1 else ''}"


def group_runs(rank_dirs: Mapping[str, int | None]) -> list[Run]:
    """The runs of the rank directories ({directory: rank}), oldest first."""
    runs: dict[str, Run] = {}
    for directory, rank in rank_dirs.items():
        ids = runs_of(directory)
        problem = None if ids else run_file_problem(directory)
        if not ids:
            try:
                mtime = datetime.fromtimestamp(os.path.getmtime(directory)).isoformat(timespec="seconds")
            except OSError:
                mtime = ""
            ids = [(NO_RUN, mtime)]
        for run_id, started in ids:
            run = runs.setdefault(run_id, Run(run_id, started))
            if problem is not None:
                run.damaged[directory] = problem
            run.started = max(run.started, started) if run_id == NO_RUN else min(run.started, started) or started
            run.dirs.append(directory)
            if rank is not None:
                run.ranks.add(rank)
    return sorted(runs.values(), key=lambda r: (r.started, r.run_id))


class RunChoiceError(ValueError):
    """`--run` names no run of the directory, or more than one."""


def choose_run(runs: list[Run], wanted: str | None) -> tuple[Run | None, list[Run]]:
    """(the run to read, the others): `wanted` (a run id or a unique start of one), else the
    newest run with an id (the directories without one, msprobe's, older msmon's, converted
    copies, only when there is no other). (None, []) for ALL_RUNS or nothing to choose from."""
    if not runs or wanted == ALL_RUNS:
        return None, []
    if wanted is None:
        chosen = ([r for r in runs if r.run_id != NO_RUN] or runs)[-1]
    else:
        matches = [r for r in runs if r.run_id == wanted] or [r for r in runs if r.run_id.startswith(wanted)]
        if len(matches) != 1:
            listed = "\n".join("  " + r.line() for r in reversed(runs))
            what = "no run" if not matches else f"{len(matches)} runs"
            raise RunChoiceError(f"--run {wanted}: {what} with that id; the runs here are:\n{listed}")
        chosen = matches[0]
    return chosen, [r for r in runs if r is not chosen]


def of_run(run_id: str | None, chosen: Run | None) -> bool:
    """Whether an anomaly record (its `run_id`, None when it has none) belongs to the chosen run
    (None: every run is read)."""
    if chosen is None:
        return True
    return run_id == chosen.run_id or (run_id is None and chosen.run_id == NO_RUN)


def choice_lines(chosen: Run | None, others: list[Run], verb: str) -> list[str]:
    """What a reader says about the run it read: the run, then the others, one line each, then
    the rank directories whose damaged run.json left them out of their run."""
    lines = damaged_lines([r for r in [chosen, *others] if r is not None], chosen, verb)
    if chosen is None or (chosen.run_id == NO_RUN and not others):  # no run ids at all: nothing more to say
        return lines
    head = [f"msmon {verb}: run {chosen.line()}"]
    if others:
        head.append(f"msmon {verb}: {len(others)} other run(s) here (choose one with --run ID, or --run all):")
        head += ["  " + r.line() for r in reversed(others)]
    return head + lines


def damaged_lines(runs: list[Run], chosen: Run | None, verb: str) -> list[str]:
    """One line per rank directory whose run.json is damaged: read as of no run, it is left out
    of the run that wrote it (which may be the newest), so the reader says so."""
    damaged = {d: why for r in runs for d, why in r.damaged.items()}
    if not damaged:
        return []
    choose = "" if chosen is not None and chosen.run_id == NO_RUN else f" (read them with --run {NO_RUN})"
    lines = [
        f"msmon {verb}: {len(damaged)} rank director{'ies' if len(damaged) > 1 else 'y'} with a damaged "
        f"{RUN_FILE}, so of no run{choose}:"
    ]
    lines += [f"  {d}: {RUN_FILE} {why}" for d, why in sorted(damaged.items())]
    return lines

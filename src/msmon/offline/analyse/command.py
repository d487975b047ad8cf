"""`msmon analyse` itself: read, order, print the first anomalies and the verdict, and write
msmon's report and msprobe's `anomaly_analyse.json` (msprobe_format) beside it."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from ...anomaly.event import NAN_ORIGIN_RULE
from ...records.layout import DUMP_DIR, DUMP_FILE, MSPROBE_DUMP_FILE
from ...records.runs import RunChoiceError
from .kind import dump_ranks, fault_kind
from .msprobe_format import MSPROBE_ANALYSE_FILE, msprobe_records
from .reading import read_dumps
from .run_choice import of_chosen_run
from .verdict import first_per_rank, format_table, order_events, verdict

RANK_FOLDER = re.compile(r"^rank\d+$")  # the dump's folder of one rank: anomaly_detected/rank<r>/
REPORT_FILE = "msmon_analyse.json"  # msmon's report; msprobe's layout is MSPROBE_ANALYSE_FILE


def output_paths(directory: str, output: str | None) -> tuple[str, str]:
    """(msmon's report, msprobe's anomaly_analyse.json). Both go into OUT when it is a
    directory (or ends with a separator), into DIR without -o, as msprobe's analyser does;
    when OUT names a file, that file is the report and msprobe's file goes beside it (unless
    OUT is itself named anomaly_analyse.json: then that is msprobe's, and the report beside)."""
    if not output or os.path.isdir(output) or output.endswith(("/", os.sep)):
        folder = output or directory
        return os.path.join(folder, REPORT_FILE), os.path.join(folder, MSPROBE_ANALYSE_FILE)
    folder = os.path.dirname(output)
    if os.path.basename(output) == MSPROBE_ANALYSE_FILE:
        return os.path.join(folder, REPORT_FILE), output
    return output, os.path.join(folder, MSPROBE_ANALYSE_FILE)


def _write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, allow_nan=False)
    os.replace(tmp, path)


def _dump_folders(directory: str) -> list[str]:
    """The `rank<r>` folders the anomaly dump made under `directory` (or its anomaly_detected):
    the dump makes them as the monitor starts, so a run with the dump on and no alert has them
    and no dump file."""
    for folder in (directory, os.path.join(directory, DUMP_DIR)):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        found = [n for n in names if RANK_FOLDER.match(n) and os.path.isdir(os.path.join(folder, n))]
        if found:
            return found
    return []


def _clean(directory: str, output: str | None, folders: list[str], run: str | None = None) -> int:
    """A run whose dump is on and empty: no anomaly, said so, and the reports written (exit 0)."""
    text = f"No anomaly: the anomaly dump of {len(folders)} rank(s) under {directory} holds no record" + (
        f" of {run}." if run else "."
    )
    print(text)
    result = {
        "directory": os.path.abspath(directory),
        "files": [],
        "skipped": [],
        "skipped_records": 0,
        "steps": None,
        "total": 0,
        "ranks": [],
        "verdict": text,
        "first_anomaly": None,
        "kind": None,
        "nan_origin": None,
        "first_per_rank": {},
        "top_k": [],
    }
    report, msprobe = output_paths(directory, output)
    for path, data in ((report, result), (msprobe, msprobe_records([]))):
        try:
            _write_json(path, data)
        except OSError as exc:
            print(f"msmon analyse: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0


def run_analyse(
    directory: str, output: str | None = None, top_k: int = 8, steps: list[int] | None = None, run: str | None = None
) -> int:
    """Read every rank's anomaly dump under `directory` (the records of the run `run`, by
    default the newest: run_choice.py), print the first `top_k` anomalies in
    training order and a verdict, and write msmon's report and msprobe's anomaly_analyse.json
    where `output_paths` says. Returns the exit code: 0 on success (a run whose dump is on
    and empty, too: no anomaly), 1 when there is nothing to analyse (no dump) or the result
    cannot be written, 2 for a bad argument."""
    err = sys.stderr
    if top_k < 1:
        print(f"msmon analyse: -k must be at least 1, got {top_k}", file=err)
        return 2
    if not os.path.isdir(directory):
        print(
            f"msmon analyse: {directory} is not a directory (expected $MONITOR_OUTPUT_DIR/anomaly_detected "
            "or a folder that holds rank*/anomaly.jsonl)",
            file=err,
        )
        return 1
    dumps = read_dumps(directory)
    for problem in dumps.problems:
        print(f"msmon analyse: {problem}", file=err)
    if dumps.skipped_records:
        print(
            f"msmon analyse: skipped {dumps.skipped_records} malformed record{'s' if dumps.skipped_records > 1 else ''}",  # noqa: E501
            file=err,
        )
    folders = _dump_folders(directory)
    if not dumps.files and not folders:
        print(
            f"msmon analyse: no anomaly dump under {directory}: no rank*/{DUMP_FILE} (nor msprobe's "
            f"{MSPROBE_DUMP_FILE}). Was alert.dump true and did any alert fire?",
            file=err,
        )
        return 1
    if dumps.files and not dumps.events:
        print(
            f"msmon analyse: {len(dumps.files)} dump file(s) under {directory}, but no readable anomaly record",
            file=err,
        )
        return 1
    try:  # which run, first: a --run that names none is an error even where the dump holds no record
        events, run_id, lines = of_chosen_run(dumps.events, directory, run)
    except RunChoiceError as exc:
        print(f"msmon analyse: {exc}", file=err)
        return 2
    for line in lines:
        print(line, file=err)
    if not events:
        return _clean(directory, output, folders, f"run {run_id}" if run_id else None)
    ordered = order_events(events)
    wanted = set(steps or ())
    selected = [e for e in ordered if e.step in wanted] if steps else ordered
    if steps and not selected:
        all_steps = sorted({e.step for e in ordered})
        print(
            f"No anomaly in step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}; anomalies were "
            f"recorded in steps {all_steps[0]}-{all_steps[-1]} ({len(all_steps)} distinct)."
        )
    top = selected[:top_k]
    job_ranks = dump_ranks(directory)
    text = verdict(selected, job_ranks) if selected else "No anomaly in the selected steps."
    kind = fault_kind(selected, job_ranks)
    if top:
        print(f"The first {len(top)} of {len(selected)} anomalies, in training order:")
        print(format_table(top))
        print()
    print(text)
    origins = [e for e in selected if e.rule == NAN_ORIGIN_RULE]
    result = {
        "directory": os.path.abspath(directory),
        "files": dumps.files,
        "skipped": dumps.problems,
        "skipped_records": dumps.skipped_records,
        "steps": list(steps) if steps else None,
        "total": len(selected),
        "ranks": sorted({e.rank for e in selected}),
        "verdict": text,
        "first_anomaly": selected[0].to_json() if selected else None,
        "kind": kind.to_json() if kind is not None else None,
        "nan_origin": origins[0].to_json() if origins else None,
        "first_per_rank": {str(r): e.to_json() for r, e in sorted(first_per_rank(selected).items())},
        "top_k": [e.to_json() for e in top],
    }
    report, msprobe = output_paths(directory, output)
    for path, data in ((report, result), (msprobe, msprobe_records(top))):
        try:
            _write_json(path, data)
        except OSError as exc:
            print(f"msmon analyse: cannot write {path}: {exc.strerror or exc}", file=err)
            return 1
    print(f"Written to {report} (and msprobe's layout to {msprobe})")
    return 0

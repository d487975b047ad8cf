"""The end-of-job summary: one line per monitor (output directory, steps recorded, alerts
raised), read from the workers' records in the bootstrap directory and each monitor's
summary.json. Nothing here guesses from directory names, so other jobs writing to the same
output directory never show up."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from typing import Any

from ..offline.analyse.run_kind import run_fault_kind
from ..output.directory import describe_stopped
from ..records.layout import DUMP_DIR, SUMMARY_FILE
from ..runtime.cost import describe
from ..system.decision import Decision
from .bootstrap.boot import WORKERS_DIR


def worker_records(bootstrap_dir: str) -> list[dict[str, Any]]:
    records = []
    for path in glob.glob(os.path.join(bootstrap_dir, WORKERS_DIR, "*.json")):
        try:
            with open(path, encoding="utf-8") as fh:
                records.append(json.load(fh))
        except (OSError, ValueError):
            continue
    records.sort(key=lambda r: (r.get("rank", 0), r.get("host", ""), r.get("pid", 0)))
    return records


def _shown(path: str) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def _read_summary(log_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(log_dir, SUMMARY_FILE), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def config_errors(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """{reason: ranks} of the workers a config error stopped before training."""
    errors: dict[str, list[Any]] = {}
    for record in records:
        if record.get("error"):
            errors.setdefault(record["error"], []).append(record.get("rank", "?"))
    return errors


def _error_lines(records: list[dict[str, Any]], config_source: str | None) -> list[str]:
    """One line per distinct config error, however many ranks it stopped: the ranks said it
    to the launcher alone (their worker records), so that it is read once, not once per rank."""
    errors = config_errors(records)
    stopped = {rank for ranks in errors.values() for rank in ranks}
    unmonitored = [r.get("rank", "?") for r in records if not r.get("error") and not r.get("monitors")]
    lines = []
    for reason, ranks in errors.items():
        where = (
            "every rank"
            if len(ranks) == len(records) or len(errors) == 1 and len(stopped) + len(unmonitored) == len(records)
            else "rank" + ("s " if len(ranks) > 1 else " ") + ", ".join(map(str, ranks))
        )
        lines.append(
            f"msmon: invalid config{f' {config_source}' if config_source else ''}: {reason}; "
            f"{where} stopped before training"
        )
    return lines


def summary_lines(
    records: list[dict[str, Any]],
    mode: str,
    output_base: str | None = None,
    run_id: str | None = None,
    *,
    config_source: str | None = None,
    decision: Decision | None = None,
) -> list[str]:
    """What the launcher prints when the job ends: a line per monitor, then (`msmon run`) the
    first non-finite value, the stop msmon decided (`decision`: system/decision.py) and where
    to look next. output_base: where `msmon struct` keeps the module trees; config_source: the
    config file, named in a config error's line."""
    if not records:
        return [
            "msmon: no training process loaded msmon, so nothing was monitored. Python started with -E, -I "
            "or -S, or a launcher that drops PYTHONPATH, skips msmon's sitecustomize: add `import msmon.auto` "
            "at the top of the training script (see docs/launcher.md)."
        ]
    lines = _error_lines(records, config_source)
    stopped = bool(lines)
    for record in records:
        where = f"rank {record.get('rank', '?')}"
        monitors = record.get("monitors", [])
        if record.get("error") or (not monitors and stopped):  # said in the config error's line
            continue
        if not monitors:
            skipped = record.get("skipped", [])
            reason = "; ".join(f"{s['optimizer']}: {s['reason']}" for s in skipped)
            written = f" -> {_shown(record['log_dir'])}" if record.get("log_dir") else ""
            lines.append(
                f"msmon: {where}: nothing was monitored ("
                + (reason or _read_note(record.get("log_dir")) or "no torch.optim optimizer was created")
                + ")"
                + written
            )
            continue
        for monitor in monitors:
            lines.append(_monitor_line(monitor, mode, len(monitors) > 1, output_base))
    if mode == "run":
        lines += _next_steps(records, run_id, decision)
    elif decision is not None:
        lines.append(decision.line)
    return lines


def _first_origin(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest first non-finite value of the ranks' summaries (by step, then rank)."""
    origins = []
    for record in records:
        for monitor in record.get("monitors", []):
            summary = _read_summary(monitor["log_dir"]) if monitor.get("log_dir") else None
            origin = (summary or {}).get("first_nonfinite")
            if isinstance(origin, dict) and isinstance(origin.get("step"), int):
                origins.append(origin)
    return min(origins, key=_training_order) if origins else None


_STAGE_ORDER = {"forward": 0, "backward": 1, "optimizer": 2}


def _training_order(origin: dict[str, Any]) -> tuple:
    """Step, micro-step (a whole-step value last), forward before backward before the optimizer, rank."""
    micro = origin.get("micro_step")
    return (
        origin["step"],
        micro if isinstance(micro, int) else float("inf"),
        _STAGE_ORDER.get(origin.get("stage", ""), len(_STAGE_ORDER)),
        origin.get("rank", 0),
    )


def describe_origin(origin: dict[str, Any]) -> str:
    """'first non-finite value: rank 1 step 3 micro-step 0, forward blocks.1.fc2.output'."""
    micro = f" micro-step {origin['micro_step']}" if origin.get("micro_step") is not None else ""
    what = f"{origin.get('stage', '?')} {origin.get('tensor') or origin.get('module') or '?'}"
    return f"first non-finite value: rank {origin.get('rank', '?')} step {origin['step']}{micro}, {what}"


def _next_steps(records: list[dict[str, Any]], run_id: str | None, decision: Decision | None = None) -> list[str]:
    """The first non-finite value, the decided stop, and the commands that read the run."""
    bases = sorted({m["output_base"] for r in records for m in r.get("monitors", []) if m.get("log_dir")})
    if not bases:
        return [decision.line] if decision is not None else []
    lines = []
    origin = _first_origin(records)
    if origin is not None:
        lines.append(f"msmon: {describe_origin(origin)}")
    lines += _kind_line(os.path.join(bases[0], DUMP_DIR), run_id)
    if decision is not None:
        lines.append(decision.line)
    out = _shown(bases[0])
    run = f" --run {run_id}" if run_id else ""
    msmon = msmon_program()
    analyse = (
        f"{msmon} analyse -d {os.path.join(out, DUMP_DIR)} (the first anomaly across ranks), "
        if os.path.isdir(os.path.join(bases[0], DUMP_DIR))
        else ""
    )
    lines.append(
        f"msmon: run {run_id or '(no id)'}; next: {analyse}{msmon} report -d {out}{run} -o report.html (one HTML page)"
    )
    return lines


def _kind_line(dump_dir: str, run_id: str | None) -> list[str]:
    """The kind of fault `msmon analyse` tells for this run's first anomaly (run_kind.py), in one line."""
    kind = run_fault_kind(dump_dir, run_id) if os.path.isdir(dump_dir) else None
    if kind is None:
        return []
    return [f"msmon: kind of fault: {kind.headline()} [{kind.code}]; {kind.why}"]


def msmon_program() -> str:
    """How to call this msmon from a fresh shell: `msmon` where PATH finds this very program,
    else its path (`.venv/bin/msmon`: `make demo` runs it without activating the venv), else
    this python with `-m msmon.launcher`."""
    beside = os.path.join(os.path.dirname(sys.executable), "msmon")
    if not os.path.isfile(beside):
        return f"{_shown(sys.executable)} -m msmon.launcher"
    found = shutil.which("msmon")
    if found and os.path.realpath(found) == os.path.realpath(beside):
        return "msmon"
    shown = _shown(beside)
    return shown if os.sep in shown else os.path.join(os.curdir, shown)  # `msmon` alone would be PATH's


def _monitor_line(monitor: dict[str, Any], mode: str, several: bool, output_base: str | None = None) -> str:
    where = f"rank {monitor.get('rank', '?')}" + (f" {monitor['optimizer']}" if several else "")
    log_dir = monitor.get("log_dir")
    if mode == "struct":
        base = output_base or monitor["output_base"]
        path = os.path.join(base, "module_struct", f"rank{monitor.get('rank', 0)}", "module_struct.json")
        if os.path.isfile(path):
            return f"msmon: {where}: module structure written to {_shown(path)}"
        return f"msmon: {where}: no module structure was written (the script made no optimizer step?)"
    if not log_dir:
        return f"msmon: {where}: not in the config's module_ranks, nothing recorded"
    summary = _read_summary(log_dir)
    stopped = monitor.get("output_stopped") or (summary or {}).get("output_stopped")
    if stopped:
        shown = dict(stopped, path=_shown(stopped["path"]) if stopped.get("path") else None)
        step = stopped.get("step")
        kept = (
            f"no step was written to {_shown(log_dir)}"
            if step == 0
            else f"what was recorded before step {step} is in {_shown(log_dir)}"
        )
        return f"msmon: {where}: {describe_stopped(shown)}; {kept}"
    if summary is None:
        return f"msmon: {where}: {_shown(log_dir)} (no summary.json: the process ended before the monitor could close)"
    cost = f", {describe(summary)}" if summary.get("monitor_cost_pct") is not None else ""
    note = f" ({summary['note']})" if summary.get("note") else ""
    return (
        f"msmon: {where}: {summary.get('steps_recorded', 0)} steps recorded{note}, {summary.get('alerts', 0)} "
        f"alerts raised{cost} -> {_shown(log_dir)}"
    )


def _read_note(log_dir: str | None) -> str | None:
    summary = _read_summary(log_dir) if log_dir else None
    return summary.get("note") if summary else None

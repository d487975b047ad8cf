"""The incident ledger, `incidents.jsonl` in the output root: one line per stop alert.actions
decided (step, verdict, ranks, hosts, exit code, why), kept across restarts of the job.

It stops restart loops. A stop that points at one rank's device or model copy exits 16
("restart elsewhere"); a scheduler that requeues on 16 restarts the job, and when the same
verdict comes back at the same step the device was not the cause: after `repeat_limit`
occurrences (default 2: the first restart that meets it again) the stop exits 17 ("do not
restart blindly") and says why from the ledger. Torch-free: `msmon run` could read it too.
Appended one fsync'd line at a time; a torn last line (a crash mid-write) is skipped.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .layout import INCIDENTS_FILE


def ledger_path(output_base: str) -> str:
    return os.path.join(output_base, INCIDENTS_FILE)


def read_incidents(output_base: str) -> list[dict[str, Any]]:
    """Every whole record of the ledger, oldest first ([] without one)."""
    try:
        with open(ledger_path(output_base), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def occurrences(incidents: list[dict[str, Any]], verdict: str | None, step: int) -> int:
    """How many earlier incidents had this verdict at this step."""
    return sum(1 for r in incidents if r.get("verdict") == verdict and r.get("step") == step)


def append_incident(output_base: str, record: dict[str, Any]) -> None:
    """Add one record (one line, flushed to disk); OSError when it cannot be written."""
    os.makedirs(output_base, exist_ok=True)
    path = ledger_path(output_base)
    with open(path, "a+b") as fh:
        torn = False
        if fh.seek(0, os.SEEK_END) > 0:
            fh.seek(-1, os.SEEK_END)
            torn = fh.read(1) != b"\n"  # an earlier run was killed mid-line
        fh.write((("\n" if torn else "") + json.dumps(record, default=str) + "\n").encode())
        fh.flush()
        os.fsync(fh.fileno())

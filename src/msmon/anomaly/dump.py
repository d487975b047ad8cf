"""Append-only anomaly dump: `anomaly_detected/rank{r}/anomaly.jsonl`, one JSON record a line.

A record is written once and never rewritten (msprobe rewrote one anomaly.json per step, so a
crash mid-write lost everything); each step's records are flushed and fsync'd together, so a
killed job loses at most the step being written, and a torn last line is all a reader can
meet. The fields, and their order, are anomaly/event.py's (the record's one declaration,
which `msmon analyse` and `msmon db` read too). Non-finite numbers are written as the strings
"nan", "inf", "-inf" (strict JSON has no literal for them).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from typing import Any

from ..records.layout import DUMP_DIR, DUMP_FILE
from ..records.rows import RowKey, StepRecord
from ..records.runs import current_run_id
from .event import FIELDS, STAGES, json_number
from .rules import Alert


def dump_path(base_dir: str, rank: int) -> str:
    """Where rank `rank` appends its anomalies under the output directory `base_dir`."""
    return os.path.join(base_dir, DUMP_DIR, f"rank{rank}", DUMP_FILE)


class AnomalyDumpWriter:
    """Appends one rank's anomaly records; safe to call from the writer thread and the
    training thread alike (one lock, one append + fsync per call)."""

    def __init__(self, base_dir: str, rank: int, pp_stage: int, group_mates: list[int]) -> None:
        self.path = dump_path(base_dir, rank)
        self.dir = os.path.dirname(self.path)
        os.makedirs(self.dir, exist_ok=True)
        self.rank = rank
        self.pp_stage = pp_stage
        self.group_mates = list(group_mates)
        self._lock = threading.Lock()
        self._tail_checked = False
        self.run_id = current_run_id()  # each record says which run wrote it (records/runs.py)

    def record(self, step: int, alert: Alert) -> dict[str, Any]:
        """The dump record of one alert (what a line of anomaly.jsonl holds)."""
        key = alert.key
        return {
            "rank": self.rank,
            "step": step,
            "micro_step": key.micro_step,
            "pp_stage": self.pp_stage,
            "vpp_stage": key.vpp_stage,
            "stage": key.train_stage,
            "call_id": alert.call_id,
            "tag": key.tag(self.rank),
            "name": key.name,
            "category": key.category,
            "op": alert.op,
            "value": json_number(alert.value),
            "history": json_number(alert.history),
            "rule": alert.rule,
            "message": alert.message,
            "group_mates": self.group_mates,
        }

    def write(self, record: StepRecord, alerts: list[Alert]) -> None:
        """Append the alerts of one step."""
        self.append(self.record(record.step, alert) for alert in alerts)

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Append ready-made records (e.g. the NanOrigin detector's) in one fsync'd write.

        rank, pp_stage and group_mates are filled in when missing; step, stage, name,
        category and rule are required, so nothing unreadable for `msmon analyse` is written.
        """
        lines = []
        for rec in records:
            full = {
                "rank": self.rank,
                "pp_stage": self.pp_stage,
                "group_mates": self.group_mates,
                "micro_step": None,
                "vpp_stage": 0,
                "call_id": -1,
                **rec,
            }
            missing = [k for k in ("step", "stage", "name", "category", "rule") if full.get(k) is None]
            if missing:
                raise ValueError(f"anomaly record lacks {', '.join(missing)}: {rec!r}")
            if full["stage"] not in STAGES:
                raise ValueError(f"anomaly record stage must be one of {STAGES}, got {full['stage']!r}")
            for field in ("value", "history"):
                if field in full:
                    full[field] = json_number(full[field])
            if not full.get("tag"):
                key = RowKey(full["category"], full["name"], full["vpp_stage"], full["micro_step"])
                full["tag"] = key.tag(full["rank"])
            ordered = {k: full[k] for k in FIELDS if k in full}
            ordered.update((k, v) for k, v in full.items() if k not in ordered)
            if self.run_id is not None:
                ordered.setdefault("run_id", self.run_id)
            lines.append(json.dumps(ordered, allow_nan=False))
        if not lines:
            return
        data = "\n".join(lines) + "\n"
        with self._lock:
            if not self._tail_checked:
                data = self._after_torn_line() + data
                self._tail_checked = True
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())

    def _after_torn_line(self) -> str:
        """A newline when an earlier run was killed mid-line, so our first record stays whole."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                if fh.tell() == 0:
                    return ""
                fh.seek(-1, os.SEEK_END)
                return "" if fh.read(1) == b"\n" else "\n"
        except FileNotFoundError:
            return ""

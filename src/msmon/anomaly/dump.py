"""Append-only anomaly dump: one JSON record per line, fsync'd once per step."""
from __future__ import annotations

import json
import os

from ..records import StepRecord
from .rules import Alert


class AnomalyDumpWriter:
    """Writes `anomaly_detected/rank{r}/anomaly.jsonl`; never rewrites what is there."""

    def __init__(self, base_dir: str, rank: int, pp_stage: int, group_mates: list[int]) -> None:
        self.dir = os.path.join(base_dir, "anomaly_detected", f"rank{rank}")
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, "anomaly.jsonl")
        self.rank = rank
        self.pp_stage = pp_stage
        self.group_mates = group_mates

    def write(self, record: StepRecord, alerts: list[Alert]) -> None:
        if not alerts:
            return
        lines = []
        for alert in alerts:
            key = alert.key
            lines.append(json.dumps({
                "rank": self.rank,
                "step": record.step,
                "micro_step": key.micro_step if key.micro_step is not None else 0,
                "pp_stage": self.pp_stage,
                "vpp_stage": key.vpp_stage,
                "stage": key.train_stage,
                "call_id": alert.call_id,
                "tag": key.tag(self.rank),
                "name": key.name,
                "category": key.category,
                "op": alert.op,
                "value": _json_number(alert.value),
                "history": _json_number(alert.history),
                "rule": alert.rule,
                "message": alert.message,
                "group_mates": self.group_mates,
            }, allow_nan=False))
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _json_number(value: float | None) -> float | str | None:
    if value is None:
        return None
    if value != value:
        return "nan"
    if value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    return value

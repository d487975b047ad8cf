"""In-memory latest values, for `generate_wgrad_metrics()` / `generate_xy_metrics()`."""

from __future__ import annotations

import threading

from ...records.rows import StepRecord
from . import sink_format
from .base import Sink


@sink_format("api")
class ApiSink(Sink):
    """Keeps the most recent step's values per category: {category: {tag: {op: value}}}.

    Every step is written here, but the API is asked rarely, so a step only keeps a reference
    to its record per category; the dictionaries are built when asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, StepRecord] = {}
        self.last_step: int | None = None

    def write(self, record: StepRecord) -> None:
        categories = {key.category for key in record.keys}
        with self._lock:
            for category in categories:
                self._latest[category] = record
            self.last_step = record.step

    def metrics(self, category: str) -> dict[str, dict[str, float]]:
        with self._lock:
            record = self._latest.get(category)
        if record is None:
            return {}
        return {
            key.tag(record.rank): dict(zip(record.ops, values))
            for key, values in zip(record.keys, record.values)
            if key.category == category
        }

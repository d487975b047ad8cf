"""In-memory latest values, for `generate_wgrad_metrics()` / `generate_xy_metrics()`."""
from __future__ import annotations

import threading
from collections import defaultdict

from ..records import StepRecord
from .base import Sink


class ApiSink(Sink):
    """Keeps the most recent step's values per category: {category: {tag: {op: value}}}."""

    name = "api"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, dict[str, dict[str, float]]] = {}
        self.last_step: int | None = None

    def write(self, record: StepRecord) -> None:
        fresh: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
        for key, values in zip(record.keys, record.values):
            fresh[key.category][key.tag(record.rank)] = dict(zip(record.ops, values))
        with self._lock:
            self._latest.update(fresh)
            self.last_step = record.step

    def metrics(self, category: str) -> dict[str, dict[str, float]]:
        with self._lock:
            return {tag: dict(ops) for tag, ops in self._latest.get(category, {}).items()}

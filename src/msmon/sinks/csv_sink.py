"""CSV files in the msprobe layout: `{category}_{first}-{last}.csv`, flushed every step."""
from __future__ import annotations

import math
import os
from typing import IO

from ..records import MICRO_STEP_CATEGORIES, StepRecord
from .base import Sink


def format_number(value: float, ndigits: int) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(round(value, ndigits))


def _first_line(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.readline().rstrip("\n") or None
    except FileNotFoundError:
        return None


class CsvSink(Sink):
    """Header `vpp_stage,name,step[,micro_step],<ops>`; one file per category and step window."""

    name = "csv"

    def __init__(self, log_dir: str, ndigits: int, step_count_per_record: int) -> None:
        self.log_dir = log_dir
        self.ndigits = ndigits
        self.window = step_count_per_record
        self._files: dict[str, tuple[str, str, IO[str], bool, list[str]]] = {}

    def _window(self, step: int) -> tuple[int, int]:
        first = step // self.window * self.window
        return first, first + self.window - 1

    def _file_for(self, category: str, step: int, ops: list[str], micro: bool) -> tuple[IO[str], bool]:
        first, last = self._window(step)
        base = os.path.join(self.log_dir, f"{category}_{first}-{last}.csv")
        current = self._files.get(category)
        if current is not None and current[0] == base and current[4] == ops:
            return current[2], current[3]
        if current is not None:
            current[2].close()
        header = ",".join(["vpp_stage", "name", "step"] + (["micro_step"] if micro else []) + list(ops))
        path = base
        if _first_line(path) not in (None, header):  # columns changed mid-window: start a new file
            path = os.path.join(self.log_dir, f"{category}_{first}-{last}_from{step}.csv")
        exists = _first_line(path) is not None
        fh = open(path, "a", encoding="utf-8")
        if not exists:
            fh.write(header + "\n")
        self._files[category] = (base, path, fh, micro, list(ops))
        return fh, micro

    def write(self, record: StepRecord) -> None:
        lines: dict[str, list[str]] = {}
        handles: dict[str, tuple[IO[str], bool]] = {}
        for key, values in zip(record.keys, record.values):
            if key.category not in handles:
                micro = key.micro_step is not None or key.category in MICRO_STEP_CATEGORIES
                handles[key.category] = self._file_for(key.category, record.step, record.ops, micro)
                lines[key.category] = []
            _, micro = handles[key.category]
            name = key.name if "," not in key.name else '"' + key.name.replace('"', '""') + '"'
            cells = [str(key.vpp_stage), name, str(record.step)]
            if micro:
                cells.append("" if key.micro_step is None else str(key.micro_step))
            cells.extend(format_number(v, self.ndigits) for v in values)
            lines[key.category].append(",".join(cells))
        for category, rows in lines.items():
            handles[category][0].write("\n".join(rows) + "\n")
        self.flush()

    def flush(self) -> None:
        for entry in self._files.values():
            entry[2].flush()

    def close(self) -> None:
        for entry in self._files.values():
            entry[2].close()
        self._files.clear()

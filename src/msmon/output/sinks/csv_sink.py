"""CSV files in the msprobe layout: `{category}_{first}-{last}.csv`, flushed every step.

A value is written as `repr(csv_value(value, ndigits))` (numbers.py: msprobe's rounding for
|v| >= 1, significant digits below, so no non-zero value reads 0). The writer thread formats
every value of every step, and on a machine with few cores its CPU time is taken from the
training, so the formatting runs on the whole step at once and each row's fixed cells are
built once.
"""

from __future__ import annotations

import os
from typing import IO, TYPE_CHECKING

import torch

from ...records.csv_cell import count_value, csv_value
from ...records.layout import csv_file_name
from ...records.rows import MICRO_STEP_CATEGORIES, RowKey, StepRecord
from ...stats.ops import COUNT_OPS
from . import sink_format
from .base import Sink, naming
from .numbers import csv_flat

if TYPE_CHECKING:
    from ...config import MonitorConfig

_MAX_CACHED_ROWS = 1 << 16


def _first_line(path: str) -> str | None:
    try:
        if os.stat(path).st_size == 0:
            return None  # nothing written yet (or not a regular file: never read without end)
        with open(path, encoding="utf-8") as fh:
            return fh.readline(1 << 20).rstrip("\n") or None
    except FileNotFoundError:
        return None


@sink_format("csv")
class CsvSink(Sink):
    """Header `vpp_stage,name,step[,micro_step],<ops>`; one file per category and step window."""

    writes_files = True

    @classmethod
    def for_rank(cls, log_dir: str, config: MonitorConfig) -> CsvSink:
        return cls(log_dir, config.ndigits, config.step_count_per_record)

    def __init__(self, log_dir: str, ndigits: int, step_count_per_record: int) -> None:
        self.log_dir = log_dir
        self.ndigits = ndigits
        self.window = step_count_per_record
        self._files: dict[str, tuple[str, str, IO[str], bool, list[str]]] = {}
        self._prefixes: dict[tuple[RowKey, bool], str] = {}

    def _window(self, step: int) -> tuple[int, int]:
        first = step // self.window * self.window
        return first, first + self.window - 1

    def _file_for(self, category: str, step: int, ops: list[str], micro: bool) -> tuple[IO[str], bool]:
        first, last = self._window(step)
        base = os.path.join(self.log_dir, csv_file_name(category, first, last))
        current = self._files.get(category)
        if current is not None and current[0] == base and current[4] == ops:
            return current[2], current[3]
        if current is not None:
            del self._files[category]
            try:
                current[2].close()
            except OSError as exc:
                raise naming(exc, current[1])
        header = ",".join(["vpp_stage", "name", "step"] + (["micro_step"] if micro else []) + list(ops))
        path = base
        if _first_line(path) not in (None, header):  # columns changed mid-window: start a new file
            path = os.path.join(self.log_dir, csv_file_name(category, first, last, step))
        exists = _first_line(path) is not None
        fh = open(path, "a", encoding="utf-8")
        self._files[category] = (base, path, fh, micro, list(ops))
        if not exists:
            self._write(category, header + "\n")
        return fh, micro

    def _prefix(self, key: RowKey, micro: bool) -> str:
        """`vpp_stage,name,` of a row (and `,micro_step` after the step): the same every step."""
        found = self._prefixes.get((key, micro))
        if found is None:
            if len(self._prefixes) >= _MAX_CACHED_ROWS:
                self._prefixes.clear()
            name = key.name if "," not in key.name else '"' + key.name.replace('"', '""') + '"'
            found = f"{key.vpp_stage},{name},"
            self._prefixes[(key, micro)] = found
        return found

    def _rounded(self, record: StepRecord) -> list[float]:
        """The step's values rounded for their cells, row after row in one flat list."""
        table = record.table
        if table is not None and table.dtype == torch.float64 and table.dim() == 2 and len(table) == len(record.keys):
            return csv_flat(table.contiguous(), self.ndigits)
        return [csv_value(v, self.ndigits) for row in record.values for v in row]

    def write(self, record: StepRecord) -> None:
        self.write_step([record])

    def write_step(self, records: list[StepRecord]) -> None:
        """A step's records (its statistics, then each category's own columns), flushed once."""
        for record in records:
            self._write_rows(record)
        self.flush()

    def _write_rows(self, record: StepRecord) -> None:
        lines: dict[str, list[str]] = {}
        handles: dict[str, tuple[IO[str], bool]] = {}
        step = f"{record.step},"
        flat = self._rounded(record)
        width = len(record.ops)
        counts = [j for j, op in enumerate(record.ops) if op in COUNT_OPS]
        if counts:  # nans, infs: integers in the cell (most are 0: no call for those)
            for start in range(0, len(flat), width):
                for j in counts:
                    value = flat[start + j]
                    flat[start + j] = 0 if value == 0.0 else count_value(value)
        for row, key in enumerate(record.keys):
            if key.category not in handles:
                micro = key.micro_step is not None or key.category in MICRO_STEP_CATEGORIES
                handles[key.category] = self._file_for(key.category, record.step, record.ops, micro)
                lines[key.category] = []
            micro = handles[key.category][1]
            cells = ",".join(map(repr, flat[row * width : (row + 1) * width]))
            if micro:
                cells = ("" if key.micro_step is None else str(key.micro_step)) + "," + cells
            lines[key.category].append(self._prefix(key, micro) + step + cells)
        for category, rows in lines.items():
            self._write(category, "\n".join(rows) + "\n")

    def _write(self, category: str, text: str) -> None:
        _, path, fh, _, _ = self._files[category]
        try:
            fh.write(text)
        except OSError as exc:
            raise naming(exc, path)

    def flush(self) -> None:
        for _, path, fh, _, _ in self._files.values():
            try:
                fh.flush()
            except OSError as exc:
                raise naming(exc, path)

    def close(self) -> None:
        """Close every file, even when one fails to flush (the first failure is raised)."""
        failure: OSError | None = None
        for _, path, fh, _, _ in self._files.values():
            try:
                fh.close()
            except OSError as exc:
                failure = failure or naming(exc, path)
        self._files.clear()
        if failure is not None:
            raise failure

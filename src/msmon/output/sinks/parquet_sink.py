"""Parquet files of `msmon db`'s long schema, per rank, for outputs that outgrow CSV.

The CSV sink writes one file per category and step window on every rank: at thousands of ranks
that is more files than a parallel file system's metadata server takes. This sink writes a
few files per rank (records/parquet_layout.py): one row per value, `run_id, rank, vpp_stage,
category, name, step, micro_step, op, value`, in row groups of at least ROW_GROUP_ROWS rows,
zstd, the strings dictionary-encoded, a new file every `parquet_roll_steps` steps or
`parquet_roll_mb` MB, each renamed to its `*.parquet` name only once it is closed. DuckDB (the
catalog `msmon db` makes), Spark, Trino and ClickHouse read them in place.

The values are the CSV's (`csv_value` with `ndigits`), so that the two formats of a run hold
the same numbers and `msmon db` reads either. The rows of a step are buffered, not flushed
(`flush` is a no-op): a row group is durable once its file is closed, so a rank killed
mid-run loses at most `parquet_roll_steps` steps of its open file (docs/results.md, "Parquet"). pyarrow is
an optional extra (`msmon[parquet]`): `check_formats` refuses the format before training when
it is not installed (REQUIRES, read without importing this file).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...records.csv_cell import csv_value
from ...records.parquet_files import RollingParquet
from ...records.parquet_layout import block_dir
from ...records.rows import RowKey, StepRecord
from ...records.runs import NO_RUN, current_run_id
from . import sink_format
from .base import Sink, naming
from .numbers import csv_table

if TYPE_CHECKING:
    from ...config import MonitorConfig

REQUIRES = {"pyarrow": "msmon[parquet]"}  # {module: what to install}, read by sinks.check_formats


def _fields(key: RowKey) -> tuple[str, int, str, int | None]:
    return key.category, key.vpp_stage, key.name, key.micro_step


@sink_format("parquet")
class ParquetSink(Sink):
    """One rank's Parquet files under `<output base>/parquet/run=<id>/` (opened at the first row,
    when the record says which rank this is)."""

    writes_files = True

    @classmethod
    def for_rank(cls, log_dir: str, config: MonitorConfig) -> ParquetSink:
        return cls(
            os.path.dirname(os.path.abspath(log_dir)),
            current_run_id() or NO_RUN,
            config.ndigits,
            config.parquet_roll_steps,
            config.parquet_roll_mb << 20,
        )

    def __init__(
        self, output_base: str, run_id: str, ndigits: int, roll_steps: int, roll_bytes: int, **options: int
    ) -> None:
        self.output_base = output_base
        self.run_id = run_id
        self.ndigits = ndigits
        self.roll_steps = roll_steps
        self.roll_bytes = roll_bytes
        self.options = options  # RollingParquet's (row_group_rows)
        self.files: RollingParquet | None = None

    def _files(self, rank: int) -> RollingParquet:
        if self.files is None:
            directory = block_dir(self.output_base, self.run_id, rank)
            self.files = RollingParquet(directory, rank, self.run_id, self.roll_steps, self.roll_bytes, **self.options)
        return self.files

    def _values(self, record: StepRecord) -> np.ndarray:
        """The step's values as the CSV writes them, row after row."""
        table = record.table
        if table is not None and table.dim() == 2 and tuple(table.shape) == (len(record.keys), len(record.ops)):
            return csv_table(table, self.ndigits).view(-1).numpy()
        flat = [csv_value(v, self.ndigits) for row in record.values for v in row]
        return torch.tensor(flat, dtype=torch.float64).numpy()

    def write(self, record: StepRecord) -> None:
        if not record.keys:
            return
        files = self._files(record.rank)
        width = len(record.ops)
        tensors = np.repeat(files.tensor_ids(record.keys, _fields), width)
        ops = np.tile(files.op_ids(record.ops), len(record.keys))
        steps = np.full(len(tensors), record.step, dtype=np.int64)
        try:
            files.add(steps, tensors, ops, self._values(record))
        except OSError as exc:
            raise naming(exc, files.directory)

    def flush(self) -> None:
        """Nothing: rows wait for a whole row group; a file is readable once closed."""

    def close(self) -> None:
        if self.files is not None:
            try:
                self.files.close()
            except OSError as exc:
                raise naming(exc, self.files.directory)

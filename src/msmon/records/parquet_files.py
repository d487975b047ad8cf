"""One rank's Parquet files (records/parquet_layout.py): rows buffered into large row groups,
a file per window of steps, each written under a temporary name and renamed when closed.

Torch-free, so that `msmon export --to parquet` writes CSV runs with the same code as the live
sink. pyarrow is imported with this module, which only the `parquet` format and the export load.

Rows arrive as columns for one window of steps: the step, a tensor id (`tensor_ids`: category,
pipeline chunk, name and micro-step, interned), an op id and the value. They are kept until
`row_group_rows` of them are waiting, then written as one row group (zstd; every column but
the value dictionary-encoded, so that a name costs a few bits a row; no min/max statistics on
the value, which would leave NaN out and let readers skip the row groups that hold one; rows
sorted by category and op, with a page index, so that readers skip the pages of the others).
A file is closed, and only then renamed to its `*.parquet` name, when the window of
`roll_steps` steps ends, past `roll_bytes`, or when the writer closes. Durability follows: a
row group is readable only once its file is closed (Parquet's footer, which says where every
row group is, is written last), so a rank killed with SIGKILL loses the rows of its open file,
at most `roll_steps` steps, and leaves every `*.parquet` file whole (docs/results.md, "Parquet").
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Sequence
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .parquet_layout import (
    COLUMNS,
    DICTIONARY_COLUMNS,
    SPANS_KEY,
    STATISTICS_COLUMNS,
    TENSORS_KEY,
    file_name,
    next_seq,
    unfinished_name,
    widened,
)

ROW_GROUP_ROWS = 131_072  # rows per row group at least (fewer only in a file's last one)
_ARROW_TYPES = {"VARCHAR": pa.string(), "INTEGER": pa.int32(), "BIGINT": pa.int64(), "DOUBLE": pa.float64()}
SCHEMA = pa.schema([pa.field(name, _ARROW_TYPES[kind]) for name, kind in COLUMNS])
TensorFields = tuple[str, int, str, "int | None"]  # category, vpp_stage, name, micro_step


class RollingParquet:
    """The files of `rank` in `directory` (parquet_layout.block_dir), `run_id` on every row."""

    def __init__(
        self,
        directory: str,
        rank: int,
        run_id: str,
        roll_steps: int,
        roll_bytes: int,
        row_group_rows: int = ROW_GROUP_ROWS,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.run_id = run_id
        self.roll_steps = roll_steps
        self.roll_bytes = roll_bytes
        self.row_group_rows = row_group_rows
        self.files_written: list[str] = []  # the finished files, in order
        self._seq: int | None = None  # the next file's number, found on the first open
        self._window: int | None = None  # step // roll_steps of the open file and the buffer
        self._writer: Any = None  # pq.ParquetWriter of the open file
        self._path = ""  # the open file's temporary path
        self._open_seq = 0  # and its number
        self._ids: dict[Hashable, int] = {}
        self._tensors: list[TensorFields] = []
        self._ops: dict[str, int] = {}
        self._op_names: list[str] = []
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._rows = 0
        self._order: dict[tuple[str, int, str], None] = {}  # the open file's tensors, first seen first
        self._spans: dict[str, list[int]] = {}  # the open file's steps and micro-steps per category

    # -- interning ----------------------------------------------------------------------------------
    def tensor_ids(self, keys: Sequence[Hashable], fields: Callable[[Any], TensorFields]) -> np.ndarray:
        """The ids of `keys` (any hashable naming one tensor row, a RowKey), each made once
        from `fields(key)`."""
        ids = self._ids
        out = np.empty(len(keys), dtype=np.int32)
        for i, key in enumerate(keys):
            found = ids.get(key)
            if found is None:
                found = ids[key] = len(self._tensors)
                self._tensors.append(fields(key))
            out[i] = found
        return out

    def op_ids(self, ops: Sequence[str]) -> np.ndarray:
        out = np.empty(len(ops), dtype=np.int32)
        for i, op in enumerate(ops):
            found = self._ops.get(op)
            if found is None:
                found = self._ops[op] = len(self._op_names)
                self._op_names.append(op)
            out[i] = found
        return out

    # -- rows ---------------------------------------------------------------------------------------
    def add(self, steps: np.ndarray, tensors: np.ndarray, ops: np.ndarray, values: np.ndarray) -> None:
        """Rows of one window of steps (every step in it has the same step // roll_steps): the
        file before it is closed first when the window changes."""
        if not len(steps):
            return
        window = int(steps[0]) // self.roll_steps
        if window != self._window:
            self.end_file()
            self._window = window
        self._chunks.append((steps, tensors, ops, values))
        self._rows += len(steps)
        if self._rows >= self.row_group_rows:
            self._write_row_group()
            if os.path.getsize(self._path) >= self.roll_bytes:
                self.end_file()

    def end_file(self) -> None:
        """Write what is buffered and close the open file under its final name."""
        self._write_row_group()
        if self._writer is None:
            return
        writer, path = self._writer, self._path
        self._writer = None
        writer.add_key_value_metadata(
            {TENSORS_KEY: json.dumps([list(t) for t in self._order]), SPANS_KEY: json.dumps(self._spans)}
        )
        self._order, self._spans = {}, {}
        writer.close()
        with open(path, "rb") as fh:  # the rows are on disk before the name says the file is whole
            os.fsync(fh.fileno())
        final = os.path.join(self.directory, file_name(self.rank, self._open_seq))
        os.replace(path, final)
        self.files_written.append(final)

    def close(self) -> None:
        self.end_file()

    def _open(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        if self._seq is None:
            self._seq = next_seq(self.directory, self.rank)
        self._open_seq = self._seq
        self._seq += 1
        self._path = os.path.join(self.directory, unfinished_name(self.rank, self._open_seq))
        self._writer = pq.ParquetWriter(
            self._path,
            SCHEMA,
            compression="zstd",
            use_dictionary=DICTIONARY_COLUMNS,
            write_statistics=STATISTICS_COLUMNS,
            write_page_index=True,
        )

    def _write_row_group(self) -> None:
        if not self._rows:
            return
        steps, tensors, ops, values = (np.concatenate(parts) for parts in zip(*self._chunks))
        self._chunks, rows, self._rows = [], self._rows, 0
        fields = self._tensors
        used, first = np.unique(tensors, return_index=True)
        for tensor in used[np.argsort(first)].tolist():  # the order recorded, before the rows are sorted
            category, vpp_stage, name, _ = fields[tensor]
            self._order.setdefault((category, vpp_stage, name))
        self._note_spans(steps, tensors, used)
        order = self._sorted(steps, tensors, ops)
        steps, tensors, ops, values = steps[order], tensors[order], ops[order], values[order]
        index = pa.array(tensors)
        table = pa.Table.from_arrays(
            [
                pa.repeat(self.run_id, rows),
                pa.array(np.full(rows, self.rank, dtype=np.int32)),
                pa.array([f[1] for f in fields], pa.int32()).take(index),
                pa.array([f[0] for f in fields], pa.string()).take(index),
                pa.array([f[2] for f in fields], pa.string()).take(index),
                pa.array(steps.astype(np.int64, copy=False)),
                pa.array([f[3] for f in fields], pa.int32()).take(index),
                pa.array(self._op_names, pa.string()).take(pa.array(ops)),
                pa.array(values.astype(np.float64, copy=False)),
            ],
            schema=SCHEMA,
        )
        if self._writer is None:
            self._open()
        self._writer.write_table(table, row_group_size=rows)

    def _note_spans(self, steps: np.ndarray, tensors: np.ndarray, used: np.ndarray) -> None:
        """Widen each category's steps and micro-steps (SPANS_KEY) by the row group's rows."""
        fields = self._tensors
        categories = sorted({fields[t][0] for t in used.tolist()})
        code = {c: i for i, c in enumerate(categories)}
        of_tensor = np.full(len(fields), -1, dtype=np.int64)
        for t in used.tolist():
            of_tensor[t] = code[fields[t][0]]
        of_row = of_tensor[tensors]
        for i, category in enumerate(categories):
            picked = steps[of_row == i]
            micro = [-1 if fields[t][3] is None else fields[t][3] for t in used.tolist() if fields[t][0] == category]
            got = [int(picked.min()), int(picked.max()), min(micro), max(micro)]
            self._spans[category] = widened(self._spans.get(category), got)

    def _sorted(self, steps: np.ndarray, tensors: np.ndarray, ops: np.ndarray) -> np.ndarray:
        """The rows' order in the row group: by category, op, tensor and step (names in string
        order, as readers compare them), so that each page holds one category and op, and a
        reader that filters on them (the report's loss chart and per-rank outliers) skips the
        other pages by the page index."""
        by_name = sorted(range(len(self._tensors)), key=lambda t: (self._tensors[t][0], self._tensors[t][2]))
        tensor_rank = np.empty(len(by_name), dtype=np.int64)
        tensor_rank[by_name] = np.arange(len(by_name))
        categories = sorted({f[0] for f in self._tensors})
        category_rank = np.array([categories.index(f[0]) for f in self._tensors], dtype=np.int64)
        op_rank = np.argsort(np.argsort(np.array(self._op_names, dtype=object)))
        return np.lexsort((steps, tensor_rank[tensors], op_rank[ops], category_rank[tensors]))

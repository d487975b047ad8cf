"""One rank directory's CSV files into the `parquet` format's files, as the live sink writes them.

The rows are `msmon db`'s: one per value, `op` the CSV column it came from, the rank from the
directory's name, the run id from its run.json (records/runs.py). The values are the CSV's
numbers parsed as doubles, exactly what `msmon db` loads from the same files. Files are read in
step order and rows go out a window of `roll_steps` steps at a time (a window is written once
every file that may hold its steps has been read), so memory follows the window, not the run.
A line still being written (no newline yet) is left out, as `msmon db` leaves it.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from ...records.layout import CSV_FILE
from ...records.parquet_files import RollingParquet
from ...records.parquet_layout import block_dir, next_seq
from ..results.csv_loader import KEY_COLUMNS, layout

_TYPES = {"VARCHAR": pa.string(), "INTEGER": pa.int32(), "BIGINT": pa.int64()}
Window = list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class Exported:
    """What one rank directory gave."""

    files: int = 0  # CSV files read
    values: int = 0
    skipped_lines: int = 0  # malformed lines left out
    problems: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # the Parquet files


def already_exported(output_base: str, run_id: str, rank: int) -> bool:
    """Whether `rank` has Parquet files in the run already (an export is not repeated over them)."""
    return next_seq(block_dir(output_base, run_id, rank), rank) > 0


def export_rank(rank_dir: str, rank: int, run_id: str, output_base: str, roll_steps: int, roll_bytes: int) -> Exported:
    """Write `rank_dir`'s CSV files as `rank`'s Parquet files of run `run_id` under `output_base`."""
    out = Exported()
    csvs = []
    for name in sorted(os.listdir(rank_dir)):
        match = CSV_FILE.match(name)
        if match:
            csvs.append((int(match["first"]), int(match["last"]), match["category"], os.path.join(rank_dir, name)))
    csvs.sort()
    files = RollingParquet(block_dir(output_base, run_id, rank), rank, run_id, roll_steps, roll_bytes)
    pending: dict[int, Window] = {}
    for first, _last, category, path in csvs:
        for window in sorted(w for w in pending if (w + 1) * roll_steps <= first):  # no later file holds its steps
            _add(files, pending.pop(window))
        for window, chunk in _rows(files, path, category, roll_steps, out):
            pending.setdefault(window, []).append(chunk)
    for window in sorted(pending):
        _add(files, pending[window])
    files.close()
    out.written = files.files_written
    return out


def _add(files: RollingParquet, chunks: Window) -> None:
    for steps, tensors, ops, values in chunks:
        files.add(steps, tensors, ops, values)


def _rows(
    files: RollingParquet, path: str, category: str, roll_steps: int, out: Exported
) -> list[tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]:
    """The long rows of one CSV file, a chunk per window of steps."""
    with open(path, "rb") as fh:
        data = fh.read()
    data = data[: data.rfind(b"\n") + 1]
    header = data[: data.find(b"\n")].decode("utf-8", "replace").rstrip("\r")
    columns = layout(header) if header else None
    if columns is None:
        if header:
            out.problems.append(f"{path}: not msmon's CSV layout (header {header[:80]!r}); skipped")
        return []
    out.files += 1
    skipped = 0

    def skip(_row: object) -> str:
        nonlocal skipped
        skipped += 1
        return "skip"

    table = pacsv.read_csv(
        io.BytesIO(data),
        parse_options=pacsv.ParseOptions(invalid_row_handler=skip),
        convert_options=pacsv.ConvertOptions(
            column_types={c: _TYPES[KEY_COLUMNS[c]] if c in KEY_COLUMNS else pa.float64() for c in columns},
            null_values=[""],  # `nan` is a value: NaN, as DuckDB and Python read it
            strings_can_be_null=False,
        ),
    )
    out.skipped_lines += skipped
    ops = [c for c in columns if c not in KEY_COLUMNS]
    micro = table.column("micro_step").to_pylist() if "micro_step" in columns else [None] * table.num_rows
    vpp_stages, names = table.column("vpp_stage").to_pylist(), table.column("name").to_pylist()
    keys = [(category, vpp, name, m) for vpp, name, m in zip(vpp_stages, names, micro)]
    ids = files.tensor_ids(keys, lambda key: key)
    steps = table.column("step").to_numpy()
    values = np.column_stack([table.column(op).to_numpy(zero_copy_only=False) for op in ops]).astype(np.float64)
    width = len(ops)
    op_ids = files.op_ids(ops)
    chunks = []
    windows = steps // roll_steps
    for window in np.unique(windows).tolist():
        rows = np.flatnonzero(windows == window)
        chunks.append(
            (
                int(window),
                (
                    np.repeat(steps[rows], width),
                    np.repeat(ids[rows], width),
                    np.tile(op_ids, len(rows)),
                    values[rows].reshape(-1),
                ),
            )
        )
    out.values += len(steps) * width
    return chunks

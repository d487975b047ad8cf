"""msmon's CSV files into the long `metrics` table, a batch of files at a time.

Opening a CSV file costs DuckDB's reader a couple of milliseconds, and a run writes one file
per category and step on every rank (step_count_per_record is 1 by default): half a million
files for 512 ranks. So the files are read here, their data lines prefixed with the file's id
(one bytes.replace per file) and joined into one file per column layout, which DuckDB reads
in one pass and unpivots into rows of (op, value). A file is read from a byte offset up to its
last newline: a grown file adds only its new lines, and a line still being written waits for
the next load.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .bulk import _quoted, insert_rows
from .sql import one_row

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

TAIL_CHECK = 64  # bytes before the end of what was loaded, compared before appending to it
KEY_COLUMNS = {"vpp_stage": "INTEGER", "name": "VARCHAR", "step": "BIGINT", "micro_step": "INTEGER"}
BATCH_BYTES = 64 << 20


@dataclass
class CsvWork:
    """Part of one CSV file to load: bytes from `start` (0: the whole file, header skipped)."""

    file_id: int
    path: str
    rank: int | None
    category: str
    start: int
    reload: bool
    header: str = ""
    end: int = 0  # the offset after the last complete line read
    lines: int = 0  # data lines read
    tail: str | None = None  # hex of the last TAIL_CHECK bytes before `end`
    problem: str | None = None
    gone: bool = False  # the file (its rank directory) disappeared since the scan: nothing read


def read_header(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            line = fh.readline()
    except OSError:
        return None
    return line.decode("utf-8", "replace").rstrip("\r\n") if line.endswith(b"\n") else None


def layout(header: str) -> list[str] | None:
    """The columns of a header, or None when it is not msmon's `vpp_stage,name,step[,micro_step],<ops>`."""
    columns = header.split(",")
    if columns[:3] != ["vpp_stage", "name", "step"] or len(columns) < 4 or len(set(columns)) != len(columns):
        return None
    if any(not c.replace("_", "").isalnum() for c in columns):
        return None
    return columns


def tail_of(path: str, end: int) -> str | None:
    """Hex of the TAIL_CHECK bytes before `end`: what a grown file must still hold there."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, end - TAIL_CHECK))
            return fh.read(min(end, TAIL_CHECK)).hex()
    except OSError:
        return None


def _body(work: CsvWork) -> bytes:
    """The file's complete data lines from work.start, each prefixed with the file id; sets
    work.header (when read from the start), work.end, work.lines and work.tail."""
    with open(work.path, "rb") as fh:
        fh.seek(work.start)
        data = fh.read()
    offset = 0
    if work.start == 0:
        cut = data.find(b"\n")
        if cut < 0:  # not even a whole header yet
            return b""
        work.header = data[:cut].decode("utf-8", "replace").rstrip("\r")
        offset = cut + 1
    last = max(data.rfind(b"\n"), offset - 1)
    work.end = work.start + last + 1
    work.tail = data[last + 1 - TAIL_CHECK : last + 1].hex() if last + 1 >= TAIL_CHECK else tail_of(work.path, work.end)
    lines = data[offset:last]
    if last < offset:
        return b""
    work.lines = lines.count(b"\n") + 1
    prefix = b"%d," % work.file_id
    return prefix + lines.replace(b"\n", b"\n" + prefix) + b"\n"


@dataclass
class CsvBatch:
    """Data lines of several files waiting to be inserted, grouped by column layout."""

    tmp_dir: str | None
    parts: dict[str, list[bytes]] = field(default_factory=dict)
    works: list[CsvWork] = field(default_factory=list)
    size: int = 0

    def add(self, work: CsvWork) -> None:
        """Read the work's lines into the batch (a grown file's work carries its header)."""
        try:
            body = _body(work)
        except FileNotFoundError:  # removed since the scan (its rank directory, say): left out
            work.gone = True
            return
        self.works.append(work)
        if not work.header:
            return
        if layout(work.header) is None:
            work.problem = f"{work.path}: not msmon's CSV layout (header {work.header[:80]!r}); skipped"
            work.lines = 0
            return
        if body:
            self.parts.setdefault(work.header, []).append(body)
            self.size += len(body)

    def flush(self, con: DuckDBPyConnection) -> tuple[int, int]:
        """Insert everything; returns (values inserted, lines skipped as malformed)."""
        values = skipped = 0
        insert_rows(
            con,
            "batch_files",
            [("id", "INTEGER"), ("rank", "INTEGER"), ("category", "VARCHAR")],
            ((w.file_id, w.rank, w.category) for w in self.works),
            self.tmp_dir,
        )
        reloads = [w.file_id for w in self.works if w.reload]
        if reloads:
            con.execute("DELETE FROM loaded_metrics WHERE file_id IN (SELECT unnest(?::INTEGER[]))", [reloads])
        expected: dict[str, int] = {}
        for w in self.works:
            expected[w.header] = expected.get(w.header, 0) + w.lines
        for header, parts in self.parts.items():
            added, read = _insert_layout(con, header, parts, self.tmp_dir)
            values += added
            skipped += expected.get(header, 0) - read
        con.execute("DELETE FROM batch_files")
        compact_tensors(con)
        self.parts.clear()
        self.works = []
        self.size = 0
        return values, skipped


def compact_tensors(con: DuckDBPyConnection) -> None:
    """One row per tensor in `tensors`, at the first position it was seen."""
    con.execute(
        "CREATE OR REPLACE TEMP TABLE tensors_min AS SELECT category, vpp_stage, name, min(position) AS position "
        "FROM tensors GROUP BY category, vpp_stage, name"
    )
    con.execute("DELETE FROM tensors")
    con.execute("INSERT INTO tensors SELECT * FROM tensors_min")
    con.execute("DROP TABLE tensors_min")


def _insert_layout(con: DuckDBPyConnection, header: str, parts: list[bytes], tmp_dir: str | None) -> tuple[int, int]:
    columns = layout(header) or []
    fd, path = tempfile.mkstemp(prefix="msmon-csv-", suffix=".csv", dir=tmp_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.writelines(parts)
        spec = ", ".join(["'file_id': 'INTEGER'"] + [f"'{c}': '{KEY_COLUMNS.get(c, 'DOUBLE')}'" for c in columns])
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE batch_wide AS SELECT * FROM read_csv('{_quoted(path)}', "
            f"header=false, auto_detect=false, delim=',', quote='\"', escape='\"', ignore_errors=true, "
            f"columns={{{spec}}})"
        )
    finally:
        os.unlink(path)
    read = one_row(con.execute("SELECT count(*) FROM batch_wide"))[0]
    ops = [c for c in columns if c not in KEY_COLUMNS]
    micro = "w.micro_step" if "micro_step" in columns else "NULL::INTEGER"
    added = one_row(
        con.execute(f"""
        INSERT INTO loaded_metrics (rank, vpp_stage, category, name, step, micro_step, op, value, file_id)
        SELECT b.rank, w.vpp_stage, b.category, w.name, w.step, {micro}, w.op, w.value, w.file_id
        FROM (UNPIVOT batch_wide ON {", ".join(f'"{op}"' for op in ops)} INTO NAME op VALUE value) w
        JOIN batch_files b ON b.id = w.file_id""")
    )[0]
    # a table made from one CSV read keeps the file's order (preserve_insertion_order), so a
    # row's rowid says where it was in its file
    con.execute("""
        INSERT INTO tensors
        SELECT b.category, w.vpp_stage, w.name, min(w.position)
        FROM (SELECT file_id, vpp_stage, name, rowid - min(rowid) OVER (PARTITION BY file_id) AS position
              FROM batch_wide) w
        JOIN batch_files b ON b.id = w.file_id
        GROUP BY b.category, w.vpp_stage, w.name""")
    con.execute("DROP TABLE batch_wide")
    return added, read

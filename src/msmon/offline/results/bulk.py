"""Rows from Python into DuckDB through a temporary CSV file.

DuckDB's executemany costs about a millisecond per row; its CSV reader takes millions of rows
a second, and needs neither pandas nor pyarrow. NULL is written as `\\N`; floats as Python's
repr (`nan`, `inf` and `-inf` read back as the same doubles); lists as `[1, 2]`, cast by DuckDB.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

NULL = "\\N"


def _cell(value: Any) -> Any:
    if value is None:
        return NULL
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(repr(v) for v in value) + "]"
    return value


def csv_source(path: str, columns: Sequence[tuple[str, str]]) -> str:
    """A read_csv(...) expression for a header-less file of these (name, type) columns."""
    spec = ", ".join(f"'{name}': '{_file_type(kind)}'" for name, kind in columns)
    return (
        f"read_csv('{_quoted(path)}', header=false, auto_detect=false, delim=',', quote='\"', escape='\"', "
        f"nullstr='{NULL}', columns={{{spec}}})"
    )


def _file_type(kind: str) -> str:
    return "VARCHAR" if kind.endswith("[]") else kind  # lists are cast after reading


def select_list(columns: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"CAST({name} AS {kind}) AS {name}" if kind.endswith("[]") else name for name, kind in columns)


def _quoted(path: str) -> str:
    return path.replace("'", "''")


def insert_rows(
    con: DuckDBPyConnection,
    table: str,
    columns: Sequence[tuple[str, str]],
    rows: Iterable[Sequence[Any]],
    tmp_dir: str | None = None,
) -> int:
    """Append `rows` (tuples in `columns` order) to `table`; returns how many were written."""
    fd, path = tempfile.mkstemp(prefix="msmon-rows-", suffix=".csv", dir=tmp_dir)
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            for row in rows:
                writer.writerow([_cell(v) for v in row])
                count += 1
        if count:
            names = ", ".join(name for name, _ in columns)
            con.execute(f"INSERT INTO {table} ({names}) SELECT {select_list(columns)} FROM {csv_source(path, columns)}")
    finally:
        os.unlink(path)
    return count

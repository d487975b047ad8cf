"""Opening the database: duckdb is optional, so it is imported only here, when a database is
opened, and a missing duckdb or a file that is no database is a clear error."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection


class DatabaseError(Exception):
    """The database cannot be opened or written (a clear message for the command line)."""


def connect(path: str, read_only: bool = False) -> DuckDBPyConnection:
    """A DuckDB connection to `path`, or a DatabaseError that says what to do."""
    try:
        import duckdb
    except ImportError:
        raise DatabaseError("duckdb is not installed: pip install 'msmon[db]' (or pip install duckdb)") from None
    if read_only and not os.path.isfile(path):
        raise DatabaseError(f"no database at {path} (make one with: msmon db -d <monitor output> -o {path})")
    if os.path.exists(path) and not is_duckdb_file(path):
        # DuckDB would not say so: it reads some such paths (a .csv) as a database in memory, and saves nothing
        raise DatabaseError(
            f"{path} exists and is not a DuckDB database (msmon db writes one, msmon report reads one); "
            "name a new file or a database msmon db wrote"
        )
    try:
        return duckdb.connect(path, read_only=read_only)
    except duckdb.Error as exc:
        raise DatabaseError(f"cannot open {path}: {exc}") from None


def is_duckdb_file(path: str) -> bool:
    """Whether the file starts as every DuckDB database file does (`DUCK` after an 8-byte checksum)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(12)[8:] == b"DUCK"
    except OSError:
        return False

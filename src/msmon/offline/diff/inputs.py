"""Which reader makes a side of the path given: one small reader per kind of input (an output
directory, msprobe's included; a database `msmon db` wrote; a golden file), so that a new
source of rows (Parquet files, a catalog of them) is one more reader and nothing else changes."""

from __future__ import annotations

import os

from .database_source import is_database, open_database
from .directory_source import open_directory
from .errors import DiffInputError
from .golden import is_golden, open_golden
from .source import Source


def open_input(path: str, run: str | None) -> Source:
    """The side `path` names: an output directory (msmon's or msprobe's), a database `msmon db`
    wrote, or a golden file (`msmon diff --calibrate`). DiffInputError when it is none of them."""
    if os.path.isdir(path):
        return open_directory(path, run)
    if not os.path.exists(path):
        raise DiffInputError(f"{path}: no such directory or file (an output directory, a .duckdb or a golden file)")
    if is_database(path):
        return open_database(path, run)
    if is_golden(path):
        if run is not None:
            raise DiffInputError(f"{path}: a golden file holds one run; --run does not apply to it")
        return open_golden(path)
    raise DiffInputError(
        f"{path}: neither an output directory, a database msmon db wrote, nor a golden file "
        "msmon diff --calibrate wrote"
    )

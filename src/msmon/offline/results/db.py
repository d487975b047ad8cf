"""`msmon db`: load monitor output directories into one DuckDB database, incrementally.

The `files` table remembers every file loaded: path, size, mtime, how many bytes and records
of it are in the database. A re-run skips files whose size and mtime are unchanged, reads
only the new lines of a grown CSV file (after checking that the bytes it ended on are still
there), the new events of a grown event file, and reloads anything else that changed. Each
batch of files is committed with its rows, so an interrupted load leaves a consistent
database that the next run completes. Files that disappeared from disk keep their rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .connection import DatabaseError, connect
from .load_report import LoadReport
from .loader import Loader
from .scan import has_output


def load(
    directories: Iterable[str],
    database: str,
    progress: bool | None = None,
    tmp_dir: str | None = None,
    run: str | None = None,
) -> LoadReport:
    """Load (or bring up to date) `database` from the run `run` (None: the newest; "all": every
    run) of the monitor output `directories`."""
    directories = list(directories)
    for directory in directories:  # before the database file is created
        if not os.path.isdir(directory):
            raise DatabaseError(
                f"{directory} is not a directory (expected a monitor output directory, $MONITOR_OUTPUT_DIR)"
            )
    new = not os.path.exists(database)
    con = connect(database)
    try:
        loader = Loader(con, database, tmp_dir)  # what is wrong with an existing database is said first
        if not any(has_output(directory) for directory in directories):
            raise NoOutputError(
                f"no msmon output in {', '.join(directories)}: no CSV, TensorBoard events, summary.json, "
                "config.json or anomaly dump; give the folder the run wrote to ($MONITOR_OUTPUT_DIR, default "
                "monitor_output)"
            )
        return loader.load(directories, progress, run)
    except NoOutputError:
        con.close()
        if new:  # no empty database left behind
            for path in (database, database + ".wal"):
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        con.close()


class NoOutputError(DatabaseError):
    """The folders given hold nothing msmon wrote."""

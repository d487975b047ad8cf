"""`msmon db` as a catalog: a run's Parquet files (records/parquet_layout.py) are read where they
lie, through the `metrics` view, never copied into the database.

What is loaded is what is small: each file's row count and the order its tensors were first
recorded in (both from the footer, `tensors.position`), in `files` and `tensors`; summaries,
configs and anomaly dumps as before. The view reads every closed file of the run's folders when
it is queried (a glob per `run=<id>` folder), so files a running job closes after the load are
read too; a folder holding a file that cannot be read as Parquet lists its readable files
instead, and the bad one is reported. A rank with Parquet files in the run has its statistics
read from them only: its CSV files and TensorBoard scalars (the same values, rounded alike or
in float32) are left out, and rows an earlier load copied from them are removed.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ...records.parquet_layout import TENSORS_KEY, run_of
from ...records.runs import NO_RUN, runs_of
from .bulk import _quoted, insert_rows
from .connection import DatabaseError
from .csv_loader import compact_tensors
from .scan import ANOMALIES, PARQUET, UNFINISHED, FoundFile
from .schema import LOADED_ONLY, TENSOR_COLUMNS

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

    from .load_report import LoadReport

FOOTERS_PER_QUERY = 2000  # files whose footers one DuckDB call reads
SOURCES_KEY = "parquet_sources"  # meta: what the view reads, a glob per run folder or a file


class _Every:
    """Every category: the TensorBoard scalars of a rank whose statistics are in Parquet files."""

    def __contains__(self, item: object) -> bool:
        return True


EVERY_CATEGORY: Container[str] = _Every()


@dataclass
class ParquetFound:
    """The run's Parquet files, and the rank directories whose statistics they hold."""

    files: list[FoundFile] = field(default_factory=list)  # closed: `*.parquet`
    unfinished: int = 0  # `.part-*.parquet.tmp`: still written, or left by a killed rank
    rank_dirs: dict[tuple[str, int], str] = field(default_factory=dict)  # (run id, rank): its directory
    covered: set[str] = field(default_factory=set)  # rank directories whose ranks have Parquet files

    def covers(self, f: FoundFile) -> bool:
        """Whether `f` (a CSV or event file) is in a rank directory whose statistics are in Parquet."""
        return f.rank_dir in self.covered


def of_run(f: FoundFile, chosen: set[str] | None) -> bool:
    """Whether a Parquet file belongs to the chosen runs (None: every run)."""
    return chosen is None or (run_of(f.path) or NO_RUN) in chosen


def split(found: list[FoundFile]) -> tuple[list[FoundFile], ParquetFound]:
    """(the files loaded as before, the Parquet files) of the chosen run's files."""
    parquet = ParquetFound()
    rest = []
    for f in found:
        if f.kind == PARQUET:
            parquet.files.append(f)
        elif f.kind == UNFINISHED:
            parquet.unfinished += 1
        else:
            rest.append(f)
    if not parquet.files:
        return rest, parquet
    keys = {(run_of(f.path) or NO_RUN, f.rank) for f in parquet.files}
    rank_dirs = {f.rank_dir: f.rank for f in rest if f.kind != ANOMALIES and f.rank is not None}
    for rank_dir, rank in rank_dirs.items():  # run.json read once per directory, not per file
        for run_id in [r for r, _ in runs_of(rank_dir)] or [NO_RUN]:
            parquet.rank_dirs.setdefault((run_id, rank), rank_dir)
            if (run_id, rank) in keys:
                parquet.covered.add(rank_dir)
    return rest, parquet


class Loading(Protocol):
    """What registering Parquet files needs of the load under way (loader.py's Loader, which calls
    `register`: named by this protocol, not imported, so that no import closes a circle)."""

    con: DuckDBPyConnection
    report: LoadReport
    known: dict[str, Any]
    tmp_dir: str | None

    def id_for(self, f: FoundFile) -> int: ...

    def file_row(self, f: FoundFile, file_id: int, loaded_bytes: int, records: int) -> tuple: ...

    def upsert_files(self, rows: list[tuple]) -> None: ...


def register(loader: Loading, parquet: ParquetFound) -> None:
    """Record the new Parquet files, their tensors' order, and the `metrics` view over them."""
    report, con = loader.report, loader.con
    report.unfinished_parquet = parquet.unfinished
    new = []
    for f in parquet.files:
        old = loader.known.get(f.path)
        if old is not None and old.size == f.size and old.mtime_ns == f.mtime_ns:
            report.unchanged += 1
        else:
            new.append(f)
            report.new += old is None
            report.reloaded += old is not None
    rows, positions, bad = _footers(con, [f.path for f in new])
    for path, problem in bad.items():
        report.problems.append(f"{path}: cannot be read as Parquet ({problem}); left out")
    con.begin()
    try:
        _forget_copies(con, parquet.covered)
        files = []
        for f in new:
            if f.path in rows:
                rank_dir = parquet.rank_dirs.get((run_of(f.path) or NO_RUN, f.rank or 0), f.rank_dir)
                file_id = loader.id_for(f)
                files.append(loader.file_row(dataclasses.replace(f, rank_dir=rank_dir), file_id, f.size, rows[f.path]))
                report.parquet_rows += rows[f.path]
        report.parquet_files += len(files)
        loader.upsert_files(files)
        if positions:
            insert_rows(con, "tensors", TENSOR_COLUMNS, [(*k, p) for k, p in positions.items()], loader.tmp_dir)
            compact_tensors(con)
        define_metrics(con, set(bad))
        con.commit()
    except BaseException:
        con.rollback()
        raise


def _forget_copies(con: DuckDBPyConnection, covered: set[str]) -> None:
    """Rows an earlier load copied from the CSV files and TensorBoard scalars of rank directories
    whose statistics are now read from Parquet (the event files stay: their histograms)."""
    if not covered:
        return
    dirs = sorted(covered)
    con.execute(
        "DELETE FROM loaded_metrics WHERE file_id IN (SELECT id FROM files WHERE kind IN ('csv', 'tensorboard') "
        "AND rank_dir IN (SELECT unnest(?::VARCHAR[])))",
        [dirs],
    )
    con.execute("DELETE FROM files WHERE kind = 'csv' AND rank_dir IN (SELECT unnest(?::VARCHAR[]))", [dirs])


def _footers(
    con: DuckDBPyConnection, paths: list[str]
) -> tuple[dict[str, int], dict[tuple[str, int, str], int], dict[str, str]]:
    """({path: rows}, {(category, vpp_stage, name): first position}, {unreadable path: why})."""
    rows: dict[str, int] = {}
    positions: dict[tuple[str, int, str], int] = {}
    bad: dict[str, str] = {}
    chunks = [paths[i : i + FOOTERS_PER_QUERY] for i in range(0, len(paths), FOOTERS_PER_QUERY)]
    while chunks:
        chunk = chunks.pop()
        listed = "[" + ", ".join(f"'{_quoted(p)}'" for p in chunk) + "]"
        try:
            counts = con.execute(f"SELECT file_name, num_rows FROM parquet_file_metadata({listed})").fetchall()
            orders = con.execute(
                f"SELECT file_name, decode(value) FROM parquet_kv_metadata({listed}) WHERE key = ?::BLOB",
                [TENSORS_KEY],
            ).fetchall()
        except Exception as exc:  # duckdb.Error: one file of the chunk is no Parquet file
            if len(chunk) > 1:
                chunks += [[p] for p in chunk]  # find which, one at a time
            else:
                bad[chunk[0]] = str(exc).splitlines()[0]
            continue
        rows.update((os.path.normpath(name), int(n)) for name, n in counts)
        for _name, text in orders:
            for position, (category, vpp_stage, name) in enumerate(json.loads(text)):
                key = (category, int(vpp_stage), name)
                positions[key] = min(positions.get(key, position), position)
    return rows, positions, bad


def define_metrics(con: DuckDBPyConnection, bad: set[str]) -> None:
    """`parquet_metrics` over the Parquet files in `files` (each run folder by a glob, or by its
    readable files when one of its files is bad), and `metrics` over it and `loaded_metrics`."""
    folders: dict[str, list[str]] = {}
    for (path,) in con.execute("SELECT path FROM files WHERE kind = 'parquet' ORDER BY path").fetchall():
        if os.path.exists(path):
            folders.setdefault(os.path.dirname(os.path.dirname(path)), []).append(path)
    sources = []
    for folder, paths in folders.items():
        pattern = os.path.join(folder, "*", "part-*.parquet")
        if any(os.path.dirname(os.path.dirname(p)) == folder for p in bad) or glob.escape(folder) != folder:
            sources += paths
        else:
            sources.append(pattern)
    con.execute("DELETE FROM meta WHERE key = ?", [SOURCES_KEY])
    con.execute("INSERT INTO meta VALUES (?, ?)", [SOURCES_KEY, json.dumps(sources)])
    if not sources:
        con.execute(f"CREATE OR REPLACE VIEW metrics AS {LOADED_ONLY}")
        con.execute("DROP VIEW IF EXISTS parquet_metrics")
        return
    listed = ", ".join(f"'{_quoted(s)}'" for s in sources)
    con.execute(
        f"CREATE OR REPLACE VIEW parquet_metrics AS SELECT * FROM read_parquet([{listed}], hive_partitioning = true)"
    )
    con.execute(
        f"CREATE OR REPLACE VIEW metrics AS {LOADED_ONLY} UNION ALL SELECT rank, vpp_stage, category, name, step, "
        "micro_step, op, value, NULL::INTEGER AS file_id FROM parquet_metrics"
    )


def check_sources(con: DuckDBPyConnection) -> None:
    """A DatabaseError when a place the `metrics` view reads holds no Parquet file any more (the
    output was moved or deleted), rather than DuckDB's error in the middle of a query."""
    row = con.execute("SELECT value FROM meta WHERE key = ?", [SOURCES_KEY]).fetchone()
    for source in json.loads(row[0]) if row else []:
        if not os.path.exists(source) and not glob.glob(source):
            raise DatabaseError(
                f"{source}: no Parquet file there any more; the database reads the run's Parquet files where "
                "they are: run msmon db on the output where it is now, into a new database"
            )

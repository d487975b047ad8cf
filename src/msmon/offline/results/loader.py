"""The incremental load of one `msmon db` run: which files are new, grown or changed, and their
rows into the database, a committed batch at a time."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ...anomaly.event import FIELDS
from ...records.runs import ALL_RUNS, Run, RunChoiceError, choice_lines, choose_run, group_runs, of_run
from ..analyse.reading import read_dump_files
from ..analyse.verdict import order_events
from . import parquet_catalog, schema
from .bulk import insert_rows
from .connection import DatabaseError
from .csv_loader import BATCH_BYTES, CsvBatch, CsvWork, compact_tensors, read_header, tail_of
from .load_report import LoadReport, progress_bar
from .scan import ANOMALIES, CONFIG, CSV, PARQUET, SUMMARY, TENSORBOARD, UNFINISHED, FoundFile, scan
from .schema import CONFIG_COLUMNS, FILE_COLUMNS, HISTOGRAM_COLUMNS, METRIC_COLUMNS, SUMMARY_KEYS, TENSOR_COLUMNS
from .sql import one_row
from .tb_loader import read_events

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection


@dataclass
class Known:
    """A file as the database last saw it."""

    id: int
    size: int
    mtime_ns: int
    loaded_bytes: int
    records: int
    header: str | None
    tail: str | None


class Loader:
    """One `msmon db` run over a database connection."""

    def __init__(self, con: DuckDBPyConnection, database: str, tmp_dir: str | None = None) -> None:
        self.started = time.perf_counter()
        self.con = con
        self.tmp_dir = tmp_dir
        self.report = LoadReport(database)
        schema.create(con)
        con.execute("CREATE TEMP TABLE IF NOT EXISTS batch_files (id INTEGER, rank INTEGER, category VARCHAR)")
        rows = con.execute(
            "SELECT path, id, size, mtime_ns, loaded_bytes, records, header, tail, kind FROM files"
        ).fetchall()
        self.known = {r[0]: Known(*r[1:8]) for r in rows}
        self.kinds = {r[0]: r[8] for r in rows}
        self.next_id = (one_row(con.execute("SELECT coalesce(max(id), -1) FROM files"))[0]) + 1
        self.new_ids: dict[str, int] = {}
        self.loaded_at = datetime.now()
        self.run: Run | None = None  # the run loaded (None: every run, or rank directories of no run)

    def id_for(self, f: FoundFile) -> int:
        old = self.known.get(f.path)
        if old is not None:
            return old.id
        if f.path not in self.new_ids:
            self.new_ids[f.path] = self.next_id
            self.next_id += 1
        return self.new_ids[f.path]

    # -- planning ---------------------------------------------------------------------------------
    def load(self, directories: Iterable[str], progress: bool | None = None, run: str | None = None) -> LoadReport:
        """Load the run `run` (a run id, its unique start, or ALL_RUNS; None: the newest) of the
        directories' rank directories, and its records of the anomaly dumps."""
        directories = list(directories)
        found: list[FoundFile] = []
        for directory in directories:
            if not os.path.isdir(directory):
                raise DatabaseError(
                    f"{directory} is not a directory (expected a monitor output directory, $MONITOR_OUTPUT_DIR)"
                )
            found += scan(directory)
        unique = {f.path: f for f in found}  # -d given twice, or a directory inside another
        found, parquet = parquet_catalog.split(self._of_run(list(unique.values()), run))
        on_disk = set(unique)
        self.report.missing = sum(1 for p in self.known if p not in on_disk and not os.path.exists(p))
        csv_work: list[tuple[FoundFile, CsvWork]] = []
        others: dict[str, list[tuple[FoundFile, bool, int]]] = {TENSORBOARD: [], SUMMARY: [], CONFIG: [], ANOMALIES: []}
        for f in found:
            old = self.known.get(f.path)
            if f.kind == CSV and parquet.covers(f):  # its rank's statistics are read from Parquet
                self.report.csv_in_parquet += 1
            elif old is not None and old.size == f.size and old.mtime_ns == f.mtime_ns:
                self.report.unchanged += 1
            elif f.kind == CSV:
                csv_work.append((f, self._csv_work(f, old)))
            elif f.kind == TENSORBOARD:
                append = old is not None and f.size >= old.size
                others[f.kind].append(
                    (f, old is not None and not append, old.records if append and old is not None else 0)
                )
                self._count(old, append)
            else:
                others[f.kind].append((f, old is not None, 0))
                self._count(old, False)
        total = sum(f.size - w.start for f, w in csv_work) + sum(f.size for items in others.values() for f, *_ in items)
        bar = progress_bar(total, progress)
        try:
            self._load_csv(csv_work, bar)
            csv_categories = self._csv_categories(found)
            for f, reload, skip in others[TENSORBOARD]:
                skipped = parquet_catalog.EVERY_CATEGORY if parquet.covers(f) else csv_categories.get(f.rank_dir, set())
                self._load_tensorboard(f, reload, skip, skipped)
                bar.update(f.size)
            self._load_json(others[SUMMARY] + others[CONFIG])
            bar.update(sum(f.size for f, *_ in others[SUMMARY] + others[CONFIG]))
            if others[ANOMALIES]:
                self._load_anomalies(others[ANOMALIES], on_disk)
                bar.update(sum(f.size for f, *_ in others[ANOMALIES]))
            parquet_catalog.register(self, parquet)
        finally:
            bar.close()
        roots = json.dumps(sorted({os.path.abspath(d) for d in directories} | set(self._roots())))
        self.con.execute("DELETE FROM meta WHERE key IN ('roots', 'last_load')")
        self.con.execute("INSERT INTO meta VALUES ('roots', ?), ('last_load', ?)", [roots, self.loaded_at.isoformat()])
        self.report.seconds = time.perf_counter() - self.started
        return self.report

    def _of_run(self, found: list[FoundFile], wanted: str | None) -> list[FoundFile]:
        """The files of the chosen run (the anomaly dumps whole: their records are chosen as they
        are read); the run is remembered, and a database holds one run."""
        rank_dirs = {f.rank_dir: f.rank for f in found if f.kind not in (ANOMALIES, PARQUET, UNFINISHED)}
        try:
            self.run, others = choose_run(group_runs(rank_dirs), wanted)
        except RunChoiceError as exc:
            raise DatabaseError(str(exc)) from None
        self.report.run_lines = choice_lines(self.run, others, "db")
        chosen = self.run.run_id if self.run is not None else ALL_RUNS if wanted == ALL_RUNS else None
        if chosen is None:  # no rank directory (only the anomaly dumps): no run to choose
            return found
        row = self.con.execute("SELECT value FROM meta WHERE key = 'run'").fetchone()
        if row is not None and row[0] != chosen:
            raise DatabaseError(
                f"{self.report.database} holds run {row[0]}; load run {chosen} into another database (-o), "
                f"or add --run {row[0]} to bring this one up to date"
            )
        if row is None:
            self.con.execute("INSERT INTO meta VALUES ('run', ?)", [chosen])
        runs = None if self.run is None else {self.run.run_id}
        kept = set(self.run.dirs) if self.run is not None else set()
        return [
            f
            for f in found
            if (f.kind in (PARQUET, UNFINISHED) and parquet_catalog.of_run(f, runs))
            or f.kind == ANOMALIES
            or runs is None
            or f.rank_dir in kept
        ]

    def _roots(self) -> list[str]:
        row = self.con.execute("SELECT value FROM meta WHERE key = 'roots'").fetchone()
        return json.loads(row[0]) if row else []

    def _count(self, old: Known | None, append: bool) -> None:
        if old is None:
            self.report.new += 1
        elif append:
            self.report.grown += 1
        else:
            self.report.reloaded += 1

    def _csv_work(self, f: FoundFile, old: Known | None) -> CsvWork:
        """Append when the file grew past what was loaded, its header is the same and the bytes
        the last load ended on are still there; otherwise read it again from the start."""
        if (
            old is not None
            and f.size >= old.loaded_bytes > 0
            and read_header(f.path) == old.header
            and tail_of(f.path, old.loaded_bytes) == old.tail
        ):
            self._count(old, True)
            return CsvWork(old.id, f.path, f.rank, f.category or "", old.loaded_bytes, False, old.header or "")
        self._count(old, False)
        return CsvWork(self.id_for(f), f.path, f.rank, f.category or "", 0, old is not None)

    def _csv_categories(self, found: list[FoundFile]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for f in found:
            if f.kind == CSV and f.category:
                out.setdefault(f.rank_dir, set()).add(f.category)
        for rank_dir, category in self.con.execute(
            "SELECT DISTINCT rank_dir, category FROM files WHERE kind = 'csv'"
        ).fetchall():
            out.setdefault(rank_dir, set()).add(category)
        return out

    # -- loading ----------------------------------------------------------------------------------
    def _load_csv(self, work: list[tuple[FoundFile, CsvWork]], bar: Any) -> None:
        batch = CsvBatch(self.tmp_dir)
        pending: list[tuple[FoundFile, CsvWork]] = []
        for f, w in work:
            batch.add(w)
            pending.append((f, w))
            bar.update(f.size - w.start)
            if batch.size >= BATCH_BYTES or len(pending) >= 20000:
                self._commit_csv(batch, pending)
                pending = []
        if pending:
            self._commit_csv(batch, pending)

    def _commit_csv(self, batch: CsvBatch, pending: list[tuple[FoundFile, CsvWork]]) -> None:
        con = self.con
        con.begin()
        try:
            values, skipped = batch.flush(con)
            self.report.values += values
            self.report.skipped_lines += skipped
            rows = []
            for f, w in pending:
                if w.gone:
                    self.report.vanished(f.rank_dir)
                    continue
                if w.problem:
                    self.report.problems.append(w.problem)
                old = self.known.get(f.path)
                records = (old.records if old is not None and w.start > 0 else 0) + w.lines
                rows.append(self.file_row(f, w.file_id, w.end, records, header=w.header, tail=w.tail))
            self.upsert_files(rows)
            con.commit()
        except BaseException:
            con.rollback()
            raise

    def file_row(
        self,
        f: FoundFile,
        file_id: int,
        loaded_bytes: int,
        records: int,
        rank: int | None = None,
        header: str | None = None,
        tail: str | None = None,
    ) -> tuple:
        """A row of the files table (rank: when the file's content knows it better than its directory)."""
        return (
            file_id,
            f.path,
            f.kind,
            f.rank if rank is None else rank,
            f.rank_dir,
            f.category,
            f.size,
            f.mtime_ns,
            loaded_bytes,
            records,
            header,
            tail,
            self.loaded_at,
        )

    def upsert_files(self, rows: list[tuple]) -> None:
        if not rows:
            return
        self.con.execute("DELETE FROM files WHERE id IN (SELECT unnest(?::INTEGER[]))", [[r[0] for r in rows]])
        insert_rows(self.con, "files", FILE_COLUMNS, rows, self.tmp_dir)

    def _load_tensorboard(self, f: FoundFile, reload: bool, skip: int, csv_categories: Container[str]) -> None:
        file_id = self.id_for(f)
        try:
            rows = read_events(f.path, skip, csv_categories, f.rank)
        except FileNotFoundError:  # removed since the scan
            self.report.vanished(f.rank_dir)
            return
        except Exception as exc:  # a corrupt event file is reported, the rest is loaded
            self.report.problems.append(f"{f.path}: cannot be read as TensorBoard events ({exc}); skipped")
            return
        self.report.tb_duplicates += rows.duplicates
        if rows.corrupt:
            self.report.problems.append(
                f"{f.path}: {rows.corrupt} corrupt record(s) skipped (checksum mismatch); "
                "the rest of the file was loaded"
            )
        con = self.con
        con.begin()
        try:
            if reload:
                con.execute("DELETE FROM loaded_metrics WHERE file_id = ?", [file_id])
                con.execute("DELETE FROM histograms WHERE file_id = ?", [file_id])
            self.report.values += insert_rows(
                con, "loaded_metrics", METRIC_COLUMNS, (r + (file_id,) for r in rows.scalars), self.tmp_dir
            )
            self.report.histograms += insert_rows(
                con, "histograms", HISTOGRAM_COLUMNS, (r + (file_id,) for r in rows.histograms), self.tmp_dir
            )
            if rows.positions:
                insert_rows(
                    con,
                    "tensors",
                    TENSOR_COLUMNS,
                    [(c, v, n, p) for (c, v, n), p in rows.positions.items()],
                    self.tmp_dir,
                )
                compact_tensors(con)
            rank = f.rank if f.rank is not None else next((r[0] for r in rows.scalars or rows.histograms), None)
            self.upsert_files([self.file_row(f, file_id, f.size, rows.events, rank)])
            con.commit()
        except BaseException:
            con.rollback()
            raise

    def _load_json(self, items: list[tuple[FoundFile, bool, int]]) -> None:
        if not items:
            return
        con = self.con
        summaries, configs, files = [], [], []
        for f, _reload, _ in items:
            file_id = self.id_for(f)
            try:
                with open(f.path, encoding="utf-8") as fh:
                    text = fh.read()
                data = json.loads(text)
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
            except FileNotFoundError:  # removed since the scan
                self.report.vanished(f.rank_dir)
                continue
            except (OSError, ValueError) as exc:
                self.report.problems.append(f"{f.path}: cannot be read ({exc}); skipped")
                continue
            rank = data.get("rank") if f.kind == SUMMARY and isinstance(data.get("rank"), int) else f.rank
            if f.kind == SUMMARY:
                values = [data.get(k) for k in SUMMARY_KEYS]
                values[2] = None if values[2] is None else json.dumps(values[2])
                summaries.append(
                    (rank, f.rank_dir, *[_number(v) if i != 2 else v for i, v in enumerate(values)], text, file_id)
                )
            else:
                configs.append((rank, f.rank_dir, _joined(data.get("format")), _joined(data.get("ops")), text, file_id))
            files.append(self.file_row(f, file_id, f.size, 1, rank))
        con.begin()
        try:
            ids = [r[0] for r in files]
            con.execute("DELETE FROM summaries WHERE file_id IN (SELECT unnest(?::INTEGER[]))", [ids])
            con.execute("DELETE FROM configs WHERE file_id IN (SELECT unnest(?::INTEGER[]))", [ids])
            insert_rows(
                con,
                "summaries",
                [("rank", "INTEGER"), ("rank_dir", "VARCHAR")]
                + [(k, "VARCHAR" if k == "first_nonfinite" else "DOUBLE") for k in SUMMARY_KEYS]
                + [("summary", "VARCHAR"), ("file_id", "INTEGER")],
                summaries,
                self.tmp_dir,
            )
            insert_rows(con, "configs", CONFIG_COLUMNS, configs, self.tmp_dir)
            self.upsert_files(files)
            con.commit()
        except BaseException:
            con.rollback()
            raise

    def _load_anomalies(self, items: list[tuple[FoundFile, bool, int]], on_disk: set[str]) -> None:
        """Every dump is read again (they are small) and the table rebuilt: `seq`, the training
        order, is over all ranks' records together."""
        known = [p for p, kind in self.kinds.items() if kind == ANOMALIES and p not in on_disk and os.path.exists(p)]
        paths = sorted(
            {f.path for f, *_ in items} | {p for p in on_disk if self.kinds.get(p) == ANOMALIES} | set(known)
        )
        dumps = read_dump_files(paths)
        self.report.problems += dumps.problems
        dumps.events = [e for e in dumps.events if of_run(e.run_id, self.run)]
        ordered = order_events(dumps.events)
        rows = []
        for seq, e in enumerate(ordered):
            rows.append((seq, *(getattr(e, name) for name in FIELDS), e.to_json()["description"], e.file))
        counts: dict[str, int] = {}
        for e in ordered:
            counts[e.file] = counts.get(e.file, 0) + 1
        con = self.con
        con.begin()
        try:
            con.execute("DELETE FROM anomalies")
            self.report.anomalies = insert_rows(con, "anomalies", schema.ANOMALY_COLUMNS, rows, self.tmp_dir)
            self.upsert_files(
                [self.file_row(f, self.id_for(f), f.size, counts.get(f.path, 0)) for f, _reload, _ in items]
            )
            con.commit()
        except BaseException:
            con.rollback()
            raise


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _joined(value: Any) -> str | None:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return value if isinstance(value, str) else None

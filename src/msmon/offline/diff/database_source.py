"""A database `msmon db` wrote as one side: its long `metrics` table read back into rows, its
`tensors` positions, configs and summaries. A database holds one run (the one `msmon db`
loaded); --run-a/--run-b may name it, and naming another is an error. Over Parquet output the
database is a catalog: `metrics` is a view that reads the run's Parquet files where they lie
(offline/results/parquet_catalog.py), so they must still be there; if they were moved, one line
says so before anything is read."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from ..results.connection import DatabaseError, connect, is_duckdb_file
from ..results.parquet_catalog import check_sources
from ..results.schema import SchemaError, require_msmon
from .errors import DiffInputError
from .parquet_rows import Columns
from .source import DATABASE, Chunk, RunFacts, Source
from .table import NO_MICRO, Row

FETCH = 100_000  # rows fetched at a time


def is_database(path: str) -> bool:
    return path.endswith(".duckdb") or is_duckdb_file(path)


def open_database(path: str, run: str | None) -> Source:
    with _connection(path) as con:
        facts = RunFacts(path, "database")
        stored = con.execute("SELECT value FROM meta WHERE key = 'run'").fetchone()
        facts.run_id = stored[0] if stored and stored[0] not in (None, "all") else None
        if run is not None and (facts.run_id is None or not facts.run_id.startswith(run)):
            raise DiffInputError(
                f"--run {run}: {path} holds {'run ' + facts.run_id if facts.run_id else 'no run id'} "
                "(a database holds the one run msmon db loaded)"
            )
        facts.ranks = [r for (r,) in con.execute("SELECT DISTINCT rank FROM metrics ORDER BY rank").fetchall()]
        for rank, config in con.execute("SELECT rank, config FROM configs ORDER BY rank").fetchall():
            facts.configs.setdefault(rank, _object(config))
        for rank, summary in con.execute("SELECT rank, summary FROM summaries ORDER BY rank").fetchall():
            job = _object(summary).get("job")
            if isinstance(job, dict):
                facts.jobs.setdefault(rank, job)
        kinds = {
            k
            for (k,) in con.execute(
                "SELECT DISTINCT kind FROM files WHERE kind IN ('csv', 'parquet', 'tensorboard')"
            ).fetchall()
        }
        facts.storage = sorted(kinds)
    ops = facts.configs[min(facts.configs)].get("ops") if facts.configs else None
    order = tuple(op for op in ops if isinstance(op, str)) if isinstance(ops, list) else ()
    return Source(facts, [Chunk(DATABASE, path, ops=order)])


def database_rows(path: str, order: Sequence[str] = ()) -> Iterator[Row]:
    """Every row of the database's metrics, its values gathered per tensor and (micro-)step, its
    ops in `order` (the config's `ops`: the CSV's columns) as far as it names them."""
    columns = Columns(order)
    with _connection(path) as con:
        positions = {
            (c, v, n): p
            for c, v, n, p in con.execute("SELECT category, vpp_stage, name, position FROM tensors").fetchall()
        }
        result = con.execute(
            "SELECT rank, category, vpp_stage, name, step, coalesce(micro_step, -1), op, value FROM metrics "
            "WHERE rank IS NOT NULL ORDER BY rank, category, step, micro_step, vpp_stage, name, op"
        )
        current: tuple | None = None
        ops: list[str] = []
        values: list[float] = []
        while True:
            batch = result.fetchmany(FETCH)
            if not batch:
                break
            for rank, category, vpp, name, step, micro, op, value in batch:
                key = (rank, category, vpp, name, step, micro)
                if key != current:
                    if current is not None:
                        yield _row(current, *columns.arranged(ops, values), positions)
                    current, ops, values = key, [], []
                ops.append(op)
                values.append(float("nan") if value is None else value)
        if current is not None:
            yield _row(current, *columns.arranged(ops, values), positions)


def _row(
    key: tuple, ops: tuple[str, ...], values: tuple[float, ...], positions: dict[tuple[str, int, str], int]
) -> Row:
    rank, category, vpp, name, step, micro = key
    position = positions.get((category, vpp, name), 0)
    return Row(category, vpp, name, step, NO_MICRO if micro < 0 else micro, rank, ops, values, position)


class _connection:
    """A read-only connection to a database msmon db wrote; every failure is DiffInputError."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> Any:
        try:
            self.con = connect(self.path, read_only=True)
            require_msmon(self.con, self.path)
            check_sources(self.con)
        except (DatabaseError, SchemaError) as exc:
            raise DiffInputError(str(exc)) from None
        except Exception as exc:  # duckdb's own errors: a corrupt file
            raise DiffInputError(f"{self.path}: cannot be read as a database ({exc})") from None
        return self.con

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.con.close()
        if exc is not None and not isinstance(exc, (DiffInputError, GeneratorExit)) and _is_duckdb_error(exc):
            raise DiffInputError(f"{self.path}: cannot be read as a database ({exc})") from None


def _is_duckdb_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("duckdb")


def _object(text: Any) -> dict[str, Any]:
    try:
        data = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}

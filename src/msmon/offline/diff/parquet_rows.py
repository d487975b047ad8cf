"""A rank's Parquet files (records/parquet_layout.py) read for a comparison, through DuckDB's
read_parquet: the engine `msmon db`'s catalog reads them with, already the [db] extra, and one
that joins two ranks' files and counts what they share in C++, without a row in Python.

- `rows`: every row of the files, its values gathered per tensor and (micro-)step, and each
  tensor's position from the files' footers (`msmon.tensors`: the order the monitor recorded
  the tensors in, as `msmon db`'s `tensors.position`).
- `paired`: the same rank's files on both sides, set against each other value by value in one
  join; the rows whose every value is the same on both sides (NaN as NaN) are counted, not read
  (what identical CSV files are to the CSV path), and only the others become rows. Two runs of
  hundreds of ranks that differ in a few values hold a few rows in memory, never a rank's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ...records.parquet_layout import TENSORS_KEY
from .errors import DiffInputError
from .table import NO_MICRO, Counted, Row

if TYPE_CHECKING:  # duckdb is optional and imported only where Parquet files are read
    from duckdb import DuckDBPyConnection

FETCH = 100_000  # values fetched at a time
FOOTERS = 2000  # files whose footers one query reads
INSTALL = "reading Parquet files needs duckdb: pip install 'msmon[db]' (or pip install duckdb)"
KEY = ("category", "vpp_stage", "name", "step", "micro_step")
ORDER = "category, step, micro_step, vpp_stage, name, op"
# one side's values: the long schema, a whole step's rows (no micro_step) as micro-step -1
SIDE = (
    "SELECT category, vpp_stage, name, step, coalesce(micro_step, -1) AS micro_step, op, "
    "coalesce(value, 'nan'::DOUBLE) AS value FROM read_parquet({}, hive_partitioning = false)"
)
_threads = 0  # DuckDB's threads per connection; 0: its default (every core)


def one_thread() -> None:
    """In each reading process of a pool: one thread, as many processes as cores already read."""
    global _threads
    _threads = 1


def require_duckdb() -> None:
    """DiffInputError, before anything is read, when duckdb is not installed."""
    try:
        import duckdb  # noqa: F401
    except ImportError:
        raise DiffInputError(INSTALL) from None


def rows(
    files: Sequence[str], rank: int, categories: Iterable[str] | None = None, order: Sequence[str] = ()
) -> list[Row]:
    """Every row of `rank`'s `files` (only `categories`' when given), each row's ops in `order`
    (the config's `ops`) as far as it names them."""
    with _Connection(files) as con:
        where, params = "", [list(files)]
        if categories is not None:
            where, params = " WHERE category IN (SELECT unnest(?::VARCHAR[]))", [list(files), sorted(categories)]
        positions = _positions(con, files)  # first: a query on the connection ends the one before it
        result = con.execute(f"SELECT * FROM ({SIDE.format('?')}){where} ORDER BY {ORDER}", params)
        return list(_gathered(result, rank, positions, order))


def paired(
    a_files: Sequence[str], b_files: Sequence[str], rank: int, orders: tuple[Sequence[str], Sequence[str]] = ((), ())
) -> tuple[list[Row], list[Row], Counted]:
    """(A's rows, B's rows, what the rest covers): the rows of one rank that differ in a value, an
    op or a row present on one side only, read; the rows the same on both sides, counted."""
    with _Connection([*a_files, *b_files]) as con:
        params = [list(a_files), list(b_files)]
        on = " AND ".join(f"a.{c} = b.{c}" for c in (*KEY, "op"))
        keys = ", ".join(f"coalesce(a.{c}, b.{c}) AS {c}" for c in KEY)
        con.execute(
            f"CREATE TEMP TABLE keys AS WITH a AS ({SIDE.format('?')}), b AS ({SIDE.format('?')}) "
            f"SELECT {keys}, bool_and(a.op IS NOT NULL AND b.op IS NOT NULL AND a.value IS NOT DISTINCT FROM b.value) "
            f"AS same, count(a.op) AS ops FROM a FULL OUTER JOIN b ON {on} GROUP BY ALL",
            params,
        )
        counted = _counted(con)
        differing: tuple[list[Row], list[Row]] = ([], [])
        (differing_keys,) = con.execute("SELECT count(*) FROM keys WHERE NOT same").fetchone() or (0,)
        if differing_keys:
            on_keys = " AND ".join(f"s.{c} = k.{c}" for c in KEY)
            for side, files, order in zip(differing, (a_files, b_files), orders):
                positions = _positions(con, files)  # first: a query on the connection ends the one before it
                result = con.execute(
                    f"SELECT s.* FROM ({SIDE.format('?')}) s SEMI JOIN (SELECT * FROM keys WHERE NOT same) k "
                    f"ON {on_keys} ORDER BY {ORDER}",
                    [list(files)],
                )
                side.extend(_gathered(result, rank, positions, order))
        return differing[0], differing[1], counted


def _counted(con: DuckDBPyConnection) -> Counted:
    """What the rows the same on both sides cover: rows and values per step and category, tensors."""
    out = Counted()
    for category, step, count, values in con.execute(
        "SELECT category, step, count(*), sum(ops) FROM keys WHERE same GROUP BY ALL"
    ).fetchall():
        out.rows += count
        out.values += int(values)
        out.per_step[(step, category)] += count
        out.steps.add(step)
    out.tensors = {
        (c, v, n)
        for c, v, n in con.execute("SELECT DISTINCT category, vpp_stage, name FROM keys WHERE same").fetchall()
    }
    return out


def _positions(con: DuckDBPyConnection, files: Sequence[str]) -> dict[tuple[str, int, str], int]:
    """{(category, vpp_stage, name): its first place among its category's tensors in a file's
    footer list}: the place a CSV file of the category gives the tensor's row in its step."""
    positions: dict[tuple[str, int, str], int] = {}
    listed = con.execute(
        "SELECT decode(value) FROM parquet_kv_metadata(?) WHERE key = ?::BLOB", [list(files), TENSORS_KEY]
    ).fetchall()
    for (text,) in listed:
        try:
            tensors = json.loads(text)
        except ValueError:
            continue  # a footer another writer made: positions unknown (0), the rows still read
        places: dict[str, int] = {}
        for tensor in tensors if isinstance(tensors, list) else []:
            if isinstance(tensor, list) and len(tensor) == 3:
                key = (str(tensor[0]), int(tensor[1]), str(tensor[2]))
                position = places[key[0]] = places.get(key[0], -1) + 1
                positions[key] = min(positions.get(key, position), position)
    return positions


def unreadable(files: Sequence[str]) -> dict[str, str]:
    """{file: why} of the `files` whose footer DuckDB cannot read (a damaged or truncated file,
    one that is no Parquet file); the others' footers are read in batches, a batch with a bad
    file one file at a time, as `msmon db` finds them."""
    bad: dict[str, str] = {}
    if not files:
        return bad
    with _Connection(files) as con:
        import duckdb

        batches = [list(files[i : i + FOOTERS]) for i in range(0, len(files), FOOTERS)]
        while batches:
            batch = batches.pop()
            try:
                con.execute("SELECT count(*) FROM parquet_file_metadata(?)", [batch]).fetchall()
            except duckdb.Error as exc:  # one file of the batch is no Parquet file
                if len(batch) > 1:
                    batches += [[p] for p in batch]
                else:
                    bad[batch[0]] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return bad


def _gathered(
    result: Any, rank: int, positions: dict[tuple[str, int, str], int], order: Sequence[str]
) -> Iterator[Row]:
    """Rows from values ordered by ORDER: one Row per tensor and (micro-)step, its ops together,
    in `order` (the config's `ops`: the CSV's columns), any other op after them by name."""
    current: tuple | None = None
    ops: list[str] = []
    values: list[float] = []
    columns = Columns(order)
    while batch := result.fetchmany(FETCH):
        for category, vpp, name, step, micro, op, value in batch:
            key = (category, vpp, name, step, micro)
            if key != current:
                if current is not None:
                    yield _row(current, rank, *columns.arranged(ops, values), positions)
                current, ops, values = key, [], []
            ops.append(op)
            values.append(value)
    if current is not None:
        yield _row(current, rank, *columns.arranged(ops, values), positions)


class Columns:
    """A row's ops put in the CSV's column order (`order`: the config's `ops`; any other op after
    them by name), for rows read from long rows, which hold them in no order; the ops of many
    rows are one tuple."""

    def __init__(self, order: Sequence[str]) -> None:
        self.place = {op: i for i, op in enumerate(order)}
        self.known: dict[tuple[str, ...], tuple[tuple[str, ...], list[int] | None]] = {}

    def arranged(self, ops: list[str], values: list[float]) -> tuple[tuple[str, ...], tuple[float, ...]]:
        found = self.known.get(tuple(ops))
        if found is None:
            order = sorted(range(len(ops)), key=lambda i: (self.place.get(ops[i], len(self.place)), ops[i]))
            arranged = tuple(ops[i] for i in order)
            found = self.known[tuple(ops)] = (arranged, None if arranged == tuple(ops) else order)
        arranged, index = found
        return arranged, tuple(values) if index is None else tuple(values[i] for i in index)


def _row(key: tuple, rank: int, ops: tuple[str, ...], values: tuple[float, ...], positions: dict) -> Row:
    category, vpp, name, step, micro = key
    position = positions.get((category, vpp, name), 0)
    return Row(category, vpp, name, step, NO_MICRO if micro < 0 else micro, rank, ops, values, position)


class _Connection:
    """An in-memory DuckDB connection for one rank's files; DuckDB's errors (a file that is no
    Parquet file, a column missing) become DiffInputError naming the files."""

    def __init__(self, files: Sequence[str]) -> None:
        self.files = files

    def __enter__(self) -> DuckDBPyConnection:
        require_duckdb()
        import duckdb

        self.con = duckdb.connect()
        if _threads:
            self.con.execute(f"SET threads = {_threads}")
        return self.con

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.con.close()
        if exc is not None and type(exc).__module__.startswith("duckdb"):
            where = (
                self.files[0] if len(self.files) == 1 else f"{self.files[0]} (or another of {len(self.files)} files)"
            )
            problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DiffInputError(f"{where}: cannot be read as msmon's Parquet files ({problem})") from None

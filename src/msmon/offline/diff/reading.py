"""Both sides read for comparison. Where both are output directories with the same ranks and
layout, a rank's CSV file is paired with the file of the same name on the other side, and a
pair that is byte for byte the same is counted (its rows, tensors, steps) without a value being
parsed: two 512-rank runs that differ in one value parse one pair of files. A rank's Parquet
files on both sides are joined in DuckDB, and only the rows that differ are read
(parquet_rows.paired). Every other chunk is parsed into rows. Ranks are read in parallel
processes when there are many (PARALLEL_FROM).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing import get_context

from ..results.tb_loader import read_events
from . import csv_rows, parquet_rows
from .database_source import database_rows
from .directory_source import files_of
from .errors import DiffInputError
from .names import NameMap
from .source import CSV, DATABASE, EVENTS, PARQUET, RANK_DIR, Chunk, Source
from .table import NO_MICRO, Counted, Row, SideRows

PARALLEL_FROM = 16  # ranks: fewer are read in this process


@dataclass
class ReadPair:
    """What was read: each side's rows, what identical files cover, how many files were which."""

    a: SideRows = field(default_factory=SideRows)
    b: SideRows = field(default_factory=SideRows)
    counted: Counted = field(default_factory=Counted)  # rows of files identical on both sides
    identical_files: int = 0
    parsed_chunks: int = 0

    def merge(self, other: ReadPair) -> None:
        self.a.merge(other.a)
        self.b.merge(other.b)
        self.counted.merge(other.counted)
        self.identical_files += other.identical_files
        self.parsed_chunks += other.parsed_chunks


def read_pair(a: Source, b: Source, pair_files: bool, names: NameMap, jobs: int = 1) -> ReadPair:
    """Read both sides; with `pair_files`, CSV files of the same rank and name are compared by
    their bytes first."""
    out = ReadPair()
    if a.preloaded is not None:
        out.a.merge(a.preloaded)
    if b.preloaded is not None:
        out.b.merge(b.preloaded)
    work: dict[int | None, tuple[list[Chunk], list[Chunk]]] = defaultdict(lambda: ([], []))
    for side, source in ((0, a), (1, b)):
        for chunk in source.chunks:
            work[chunk.rank][side].append(chunk)
    items = [(a_chunks, b_chunks, pair_files, names) for a_chunks, b_chunks in work.values()]
    if jobs > 1 and len(items) >= PARALLEL_FROM:
        with get_context("fork").Pool(min(jobs, len(items)), initializer=parquet_rows.one_thread) as pool:
            for part in pool.imap_unordered(_read_rank, items, chunksize=max(1, len(items) // (8 * jobs))):
                out.merge(part)
    else:
        for item in items:
            out.merge(_read_rank(item))
    return out


def _read_rank(item: tuple[list[Chunk], list[Chunk], bool, NameMap]) -> ReadPair:
    """One rank's chunks of both sides (or the chunks of no single rank: a database)."""
    a_chunks, b_chunks, pair_files, names = item
    a_chunks, b_chunks = _expanded(a_chunks), _expanded(b_chunks)
    out = ReadPair()
    a_parquet, b_parquet = [c for c in a_chunks if c.kind == PARQUET], [c for c in b_chunks if c.kind == PARQUET]
    if pair_files and len(a_parquet) == 1 and len(b_parquet) == 1:  # the rank in Parquet on both sides
        a_chunks.remove(a_parquet[0])
        b_chunks.remove(b_parquet[0])
        a_rank, b_rank = a_parquet[0], b_parquet[0]
        rows_a, rows_b, counted = parquet_rows.paired(
            a_rank.files, b_rank.files, a_rank.rank or 0, (a_rank.ops, b_rank.ops)
        )
        _add(out.a, rows_a, names)
        _add(out.b, rows_b, None)
        out.counted.merge(counted)
        out.parsed_chunks += 2
    paired: dict[tuple[int, str], Chunk] = {}
    if pair_files:  # files whose (rank, name) is one file on each side
        unique_a, unique_b = _unique(a_chunks), _unique(b_chunks)
        paired = {key: unique_b[key] for key in unique_a.keys() & unique_b.keys()}
    taken = set(paired)
    counts: dict[str, list[csv_rows.FileCount]] = defaultdict(list)
    for chunk in a_chunks:
        if chunk.pair_key in taken:
            other = paired[chunk.pair_key]
            data_a, data_b = _bytes(chunk), _bytes(other)
            if data_a == data_b or csv_rows.complete_lines(data_a) == csv_rows.complete_lines(data_b):
                counts[chunk.category or ""].append(csv_rows.count(data_a, chunk.path, chunk.category or ""))
                out.identical_files += 1
                continue
            _add(out.a, _csv(chunk, data_a), names)
            _add(out.b, _csv(other, data_b), None)
            out.parsed_chunks += 2
        else:
            _add(out.a, rows_of(chunk), names)
            out.parsed_chunks += 1
    for chunk in b_chunks:
        if chunk.pair_key not in taken or chunk.pair_key is None:
            _add(out.b, rows_of(chunk), None)
            out.parsed_chunks += 1
    for category, files in counts.items():
        out.counted.merge(csv_rows.counted(category, files))
    return out


def _unique(chunks: list[Chunk]) -> dict[tuple[int, str], Chunk]:
    """{pair key: chunk} of the chunks whose pair key no other chunk of the side has."""
    seen: dict[tuple[int, str], Chunk | None] = {}
    for chunk in chunks:
        if chunk.pair_key is not None:
            seen[chunk.pair_key] = None if chunk.pair_key in seen else chunk
    return {key: chunk for key, chunk in seen.items() if chunk is not None}


def _expanded(chunks: list[Chunk]) -> list[Chunk]:
    """Rank directories replaced by their files."""
    return [f for c in chunks for f in (files_of(c) if c.kind == RANK_DIR else [c])]


def _add(side: SideRows, rows: Iterable[Row], names: NameMap | None) -> None:
    for row in rows:
        if names is not None and names:
            row.name = names.rename(row.name)
        side.add(row)


def rows_of(chunk: Chunk) -> Iterable[Row]:
    """The rows of one chunk."""
    if chunk.kind == RANK_DIR:
        return [row for f in files_of(chunk) for row in rows_of(f)]
    if chunk.kind == CSV:
        return _csv(chunk, _bytes(chunk))
    if chunk.kind == EVENTS:
        return _events(chunk)
    if chunk.kind == PARQUET:
        return parquet_rows.rows(chunk.files, chunk.rank or 0, order=chunk.ops)
    if chunk.kind == DATABASE:
        return database_rows(chunk.path, chunk.ops)
    raise ValueError(f"unknown chunk kind {chunk.kind}")


def _bytes(chunk: Chunk) -> bytes:
    try:
        with open(chunk.path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise DiffInputError(f"{chunk.path}: cannot be read ({exc.strerror or exc})") from None


def _csv(chunk: Chunk, data: bytes) -> list[Row]:
    return csv_rows.parse(data, chunk.path, chunk.rank or 0, chunk.category or "")


def _events(chunk: Chunk) -> list[Row]:
    """An event file's scalars gathered into rows (one per tensor and (micro-)step)."""
    try:
        found = read_events(chunk.path, 0, set(chunk.skip_categories), chunk.rank)
    except OSError as exc:
        raise DiffInputError(f"{chunk.path}: cannot be read ({exc.strerror or exc})") from None
    gathered: dict[tuple, tuple[list[str], list[float]]] = {}
    for rank, vpp, category, name, step, micro, op, value in found.scalars:
        ops, values = gathered.setdefault(
            (category, vpp, name, step, NO_MICRO if micro is None else micro, rank), ([], [])
        )
        if op not in ops:
            ops.append(op)
            values.append(value)
    return [
        Row(
            category,
            vpp,
            name,
            step,
            micro,
            rank,
            tuple(ops),
            tuple(values),
            found.positions.get((category, vpp, name), 0),
        )
        for (category, vpp, name, step, micro, rank), (ops, values) in gathered.items()
    ]


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, 8))

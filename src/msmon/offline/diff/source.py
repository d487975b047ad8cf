"""One side of a comparison, whatever it was read from: the run's facts (ranks, configs, what
each rank's summary.json says of the job) and where its rows are (chunks). inputs.py chooses
the reader that makes one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .table import SideRows

CSV, EVENTS, DATABASE, RANK_DIR, PARQUET = "csv", "events", "database", "rank_dir", "parquet"


@dataclass(frozen=True)
class Chunk:
    """Rows from one place: a rank directory (its files listed when it is read), a CSV file (one
    rank, one category), an event file (one rank), a rank's Parquet files in a run (`files`), a
    database (every rank). Two CSV chunks with the same `pair_key` on both sides hold the same
    rows when their bytes are the same, and are then counted without being parsed; a rank's
    Parquet files on both sides are set against each other in one join (parquet_rows.paired)."""

    kind: str  # RANK_DIR | CSV | EVENTS | PARQUET | DATABASE
    path: str
    rank: int | None = None
    category: str | None = None
    pair_key: tuple[int, str] | None = None  # (rank, file name)
    skip_categories: frozenset[str] = frozenset()  # an event file's categories that CSV files hold
    files: tuple[str, ...] = ()  # PARQUET: the rank's closed `*.parquet` files of the run
    ops: tuple[str, ...] = ()  # PARQUET, DATABASE: the config's `ops`, the order of the CSV's columns


@dataclass
class RunFacts:
    """What one side is: where it came from, which run, its ranks, configs and job facts."""

    input: str
    kind: str  # "output directory", "database", "golden file"
    run_id: str | None = None
    run_lines: list[str] = field(default_factory=list)  # the run chosen and the others, one line each
    ranks: list[int] = field(default_factory=list)
    configs: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> resolved config.json
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> summary.json's "job"
    storage: list[str] = field(default_factory=list)  # how the values were stored: "csv", "parquet", "tensorboard"

    def describe(self) -> str:
        run = f", run {self.run_id}" if self.run_id else ""
        ranks = len(self.ranks)
        return f"{self.input} ({self.kind}{run}, {ranks} rank{'s' if ranks != 1 else ''})"

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "kind": self.kind, "run": self.run_id, "ranks": self.ranks}


@dataclass
class Source:
    """One side: its facts and its chunks (or, for a golden file, its rows already read)."""

    facts: RunFacts
    chunks: list[Chunk] = field(default_factory=list)
    preloaded: SideRows | None = None


def read_json(path: str) -> dict[str, Any] | None:
    """A JSON object from a file, None when it is missing or no object (a rank's own files:
    what they lack is said as unknown, never an error)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

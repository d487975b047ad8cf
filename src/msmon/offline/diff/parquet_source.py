"""The Parquet files of an output directory (records/parquet_layout.py) as part of one side.

`<out>/parquet/run=<id>/rank_block=<b>/part-<rank>-<seq>.parquet` holds every category of a
rank in a few files; the rank directories beside it still hold the run's run.json, config.json
and summary.json. As `msmon db` does (offline/results/parquet_catalog.py), a rank with Parquet
files in the run has its statistics read from them only: its CSV files and TensorBoard scalars
hold the same values (the sink writes the CSV's rounding), and reading both would count every
value twice. A `.part-*.parquet.tmp` file is still being written, or was left by a killed rank:
never read, said in one line. A `*.parquet` file that is no readable Parquet file is left out,
named in one line, as `msmon db` leaves it out.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, field

from ...records.parquet_layout import PARQUET_FILE, UNFINISHED_FILE, rank_of_file, run_of
from ...records.runs import NO_RUN, Run
from . import parquet_rows

RUN_ID_TIME = re.compile(r"^(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})(\d{2})-")


@dataclass
class ParquetIndex:
    """The Parquet files found under a side's path: {run id: {rank: [closed files]}}, and the
    unfinished ones per run."""

    files: dict[str, dict[int, list[str]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    unfinished: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, path: str, name: str) -> bool:
        """Take `path` when its name is a Parquet file's of the layout (True), else leave it."""
        closed = PARQUET_FILE.match(name) is not None
        if not closed and UNFINISHED_FILE.match(name) is None:
            return False
        run = run_of(path) or NO_RUN
        if closed:
            self.files[run][rank_of_file(name) or 0].append(path)
        else:
            self.unfinished[run] += 1
        return True

    def covers(self, run_id: str, rank: int) -> bool:
        return rank in self.files.get(run_id, {})

    def runs_without_directories(self, named: set[str]) -> list[Run]:
        """The runs that only Parquet files hold (their rank directories not copied along)."""
        return [
            Run(run_id, _started(run_id), [], set(by_rank))
            for run_id, by_rank in self.files.items()
            if run_id not in named
        ]

    def of_run(self, run_id: str) -> tuple[dict[int, list[str]], list[str]]:
        """({rank: its readable files, in order}, lines to say) of one run: its unfinished files
        counted, and the files that cannot be read as Parquet named and left out."""
        by_rank = {rank: sorted(paths) for rank, paths in self.files.get(run_id, {}).items()}
        lines = []
        bad = parquet_rows.unreadable([p for paths in by_rank.values() for p in paths])
        for path, problem in sorted(bad.items()):
            lines.append(f"msmon diff: {path}: cannot be read as Parquet ({problem}); left out")
        if bad:
            by_rank = {r: kept for r, paths in by_rank.items() if (kept := [p for p in paths if p not in bad])}
        unfinished = self.unfinished.get(run_id, 0)
        if unfinished:
            lines.append(
                f"msmon diff: {unfinished:,} Parquet file(s) not closed yet (.part-*.parquet.tmp: still written, "
                "or left by a killed rank): not read"
            )
        return by_rank, lines


def _started(run_id: str) -> str:
    """A run's start from its id (`20261206-031500-1a2b3c`), to order it among the others."""
    match = RUN_ID_TIME.match(run_id)
    if match is None:
        return ""
    y, mo, d, h, mi, s = match.groups()
    return f"{y}-{mo}-{d}T{h}:{mi}:{s}"


def folder_of(files: list[str]) -> str:
    """The `run=<id>` folder of a rank's files (what a Parquet chunk names as its place)."""
    return os.path.dirname(os.path.dirname(files[0]))

"""An output directory as one side: msmon's, with its runs, or msprobe's `monitor` output (the
same rank directories and CSV files, without run.json, config.json or summary.json).

The directory is walked however deep, its files told apart by name as `msmon db` tells them
(offline/results/scan.py's classify; no file is stat'ed: half a million files cost seconds); the run
is chosen as every reader chooses it (records/runs.py: the newest unless --run-a/--run-b names
one). A rank's CSV files are its chunks; an event file is read only for the categories that
have no CSV file in its directory. A rank with Parquet files in the run (`format: parquet`,
`msmon export --to parquet`) is read from them instead (parquet_source.py), as `msmon db` reads
it. Rows moved aside by a resumed run (`superseded_from_step*`) are not part of the run.
"""

from __future__ import annotations

import os
from collections import defaultdict

from ...records.layout import CONFIG_FILE, RUN_FILE, SUMMARY_FILE
from ...records.runs import ALL_RUNS, NO_RUN, RunChoiceError, choice_lines, choose_run, group_runs, runs_of
from ..results.scan import CSV, TENSORBOARD, classify, rank_of_dir
from .errors import DiffInputError
from .parquet_source import ParquetIndex, folder_of
from .source import CSV as CSV_CHUNK
from .source import EVENTS, PARQUET, RANK_DIR, Chunk, RunFacts, Source, read_json

SUPERSEDED = "superseded_from_step"
RANK_FILES = (RUN_FILE, SUMMARY_FILE, CONFIG_FILE)  # a rank directory's own files, beside its statistics


def open_directory(path: str, run: str | None) -> Source:
    if run == ALL_RUNS:
        raise DiffInputError("--run all: a comparison reads one run of each side; name one run id")
    found, parquet, bare = _statistics_directories(path)
    if not found and not parquet.files:
        raise DiffInputError(
            f"{path}: no statistics (no CSV, Parquet or TensorBoard files of msmon or msprobe's monitor) under it"
        )
    for directory, rank in bare.items():  # a rank directory whose statistics are all in Parquet files
        if any(parquet.covers(run_id, rank) for run_id in [r for r, _ in runs_of(directory)] or [NO_RUN]):
            found[directory] = (rank, set())
    ranks_of = _ranks(path, {d: rank for d, (rank, _) in found.items()})
    runs = group_runs(ranks_of)
    runs = sorted(
        runs + parquet.runs_without_directories({r.run_id for r in runs}), key=lambda r: (r.started, r.run_id)
    )
    try:
        chosen, others = choose_run(runs, run)
    except RunChoiceError as exc:
        raise DiffInputError(str(exc).replace("\n", " ")) from None
    facts = RunFacts(os.path.abspath(path), "output directory")
    dirs = set(ranks_of) if chosen is None else set(chosen.dirs)
    if chosen is not None:
        facts.run_id = None if chosen.run_id == NO_RUN else chosen.run_id
        facts.run_lines = choice_lines(chosen, others, "diff")
    dirs, note = _one_directory_per_rank(dirs, ranks_of, chosen is not None and chosen.run_id == NO_RUN)
    facts.run_lines += note
    in_parquet, lines = parquet.of_run(chosen.run_id if chosen is not None else NO_RUN)
    facts.run_lines += lines
    storage: set[str] = {"parquet"} if in_parquet else set()
    chunks: list[Chunk] = []
    for directory in sorted(dirs, key=lambda d: (ranks_of[d], d)):
        rank = ranks_of[directory]
        if rank not in in_parquet:
            chunks.append(Chunk(RANK_DIR, directory, rank))
            storage |= found[directory][1]
        config, summary = (
            read_json(os.path.join(directory, CONFIG_FILE)),
            read_json(os.path.join(directory, SUMMARY_FILE)),
        )
        if config is not None:
            facts.configs.setdefault(rank, config)
        job = summary.get("job") if summary is not None else None
        if isinstance(job, dict):
            facts.jobs.setdefault(rank, job)
    for rank, files in sorted(in_parquet.items()):
        ops = facts.configs.get(rank, {}).get("ops")
        order = tuple(op for op in ops if isinstance(op, str)) if isinstance(ops, list) else ()
        chunks.append(Chunk(PARQUET, folder_of(files), rank, files=tuple(files), ops=order))
    facts.storage = sorted(storage)
    facts.ranks = sorted({ranks_of[d] for d in dirs} | set(in_parquet))
    return Source(facts, chunks)


def _statistics_directories(root: str) -> tuple[dict[str, tuple[int | None, set[str]]], ParquetIndex, dict[str, int]]:
    """({directory: (its rank, "csv" and/or "tensorboard")} of every directory under `root` that
    holds statistics (not a resumed run's superseded_from_step*), the Parquet files found,
    {rank directory without CSV or TensorBoard files: its rank})."""
    found: dict[str, tuple[int | None, set[str]]] = {}
    parquet = ParquetIndex()
    bare: dict[str, int] = {}
    stack = [os.path.abspath(root)]
    while stack:
        directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        kinds: set[str] = set()
        own_files = False
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if not entry.name.startswith(SUPERSEDED):
                    stack.append(entry.path)
            elif entry.name in RANK_FILES:
                own_files = True
            elif entry.name.endswith(("parquet", ".tmp")) and parquet.add(entry.path, entry.name):
                continue
            elif len(kinds) < 2:
                kind = classify(entry.name)
                if kind is not None and kind[0] in (CSV, TENSORBOARD):
                    kinds.add("csv" if kind[0] == CSV else "tensorboard")
        if kinds:
            found[directory] = (rank_of_dir(directory), kinds)
        elif own_files and (rank := rank_of_dir(directory)) is not None:
            bare[directory] = rank
    return found, parquet, bare


def _ranks(path: str, ranks: dict[str, int | None]) -> dict[str, int]:
    """{rank directory: rank}; a directory whose rank cannot be told is rank 0 when it is the
    only one (a rank's files copied out on their own), else an error."""
    unknown = sorted(d for d, r in ranks.items() if r is None)
    if unknown and len(ranks) > 1:
        raise DiffInputError(
            f"{unknown[0]}: cannot tell which rank wrote it (no -rank<r>- in its name, no summary.json); "
            f"give the monitor output directory the job wrote ({path} holds {len(ranks)} directories)"
        )
    return {d: (0 if r is None else r) for d, r in ranks.items()}


def _one_directory_per_rank(dirs: set[str], ranks_of: dict[str, int], unlabelled: bool) -> tuple[set[str], list[str]]:
    """A rank with several directories and no run id to tell them apart (msprobe's output, several
    jobs in one folder): its newest is read, and a line says so."""
    by_rank: dict[int, list[str]] = defaultdict(list)
    for d in dirs:
        by_rank[ranks_of[d]].append(d)
    several = {rank: ds for rank, ds in by_rank.items() if len(ds) > 1}
    if not several or not unlabelled:
        return dirs, []
    kept = {max(ds, key=_mtime) for ds in by_rank.values()}
    example = min(several)
    line = (
        f"msmon diff: {len(several)} rank(s) have several directories without run ids (rank {example}: "
        f"{len(several[example])}); the newest of each rank is read"
    )
    return kept, [line]


def _mtime(directory: str) -> float:
    try:
        return os.path.getmtime(directory)
    except OSError:
        return 0.0


def files_of(chunk: Chunk) -> list[Chunk]:
    """A rank directory's CSV files, and its event files for the categories no CSV file holds."""
    try:
        names = sorted(entry.name for entry in os.scandir(chunk.path) if not entry.is_dir(follow_symlinks=False))
    except OSError as exc:
        raise DiffInputError(f"{chunk.path}: cannot be listed ({exc.strerror or exc})") from None
    rank = chunk.rank if chunk.rank is not None else 0
    csv_files, events = [], []
    for name in names:
        kind = classify(name)
        if kind is not None and kind[0] == CSV:
            csv_files.append((name, kind[1]))
        elif kind is not None and kind[0] == TENSORBOARD:
            events.append(name)
    with_csv = frozenset(category for _, category in csv_files if category)
    out = [Chunk(CSV_CHUNK, os.path.join(chunk.path, n), rank, c, (rank, n)) for n, c in csv_files]
    out += [Chunk(EVENTS, os.path.join(chunk.path, n), rank, None, None, with_csv) for n in events]
    return out

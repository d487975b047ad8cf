"""Where the `parquet` format's files go and what their rows hold, torch- and pyarrow-free: the
sink writes them, `msmon export --to parquet` writes them from CSV, and `msmon db` finds them by
these names alone (a catalog, not a copy).

One dataset for the whole output directory, in the Hive layout that DuckDB, Spark, Trino and
ClickHouse read as one table:

    <out>/parquet/run=<run id>/rank_block=<first rank>/part-<rank>-<seq>.parquet

- `run=`: the run id of `msmon run` (records/runs.py), `unlabelled` without one;
- `rank_block=`: ranks in blocks of RANK_BLOCK (0, 256, 512, ...), so that no folder holds more
  than RANK_BLOCK ranks' files at sixteen thousand ranks;
- one file per rank and window of `parquet_roll_steps` steps (sooner past `parquet_roll_mb`),
  every category in it: the file count is what a parallel file system's metadata server pays
  for, and a `category=` folder level would multiply it by the number of categories (and cut
  the row groups as many times smaller), so the category is a column; the rows of a row group
  are sorted by it, with a page index, so that a reader of one category skips the others' pages;
- a file is written as `.part-<rank>-<seq>.parquet.tmp` and renamed when closed: every file
  named `*.parquet` is whole, and a rank killed mid-write leaves only a hidden `.tmp` file
  that no engine reads (Spark and Hive skip names starting with a dot, and `*.parquet` globs
  do not match it).

The partition keys (`run`, `rank_block`) are not the names of columns in the files (`run_id`,
`rank`): Spark refuses a partition column that is also a data column.
"""

from __future__ import annotations

import os
import re

PARQUET_DIR = "parquet"  # <out>/parquet/: the dataset's root
RUN_KEY = "run"
RANK_BLOCK_KEY = "rank_block"
RANK_BLOCK = 256  # ranks per rank_block folder
PARQUET_FILE = re.compile(r"^part-(?P<rank>\d+)-(?P<seq>\d+)\.parquet$")
UNFINISHED_FILE = re.compile(r"^\.part-(?P<rank>\d+)-(?P<seq>\d+)\.parquet\.tmp$")
# the footer's key-value entry that lists the file's tensors, [[category, vpp_stage, name], ...],
# in the order they were first recorded in it (execution order for activations): `msmon db`'s
# `tensors.position`, read from the footers without reading the rows
TENSORS_KEY = "msmon.tensors"
# the footer's entry that gives each category's steps and micro-steps in the file,
# {category: [first step, last step, first micro-step, last micro-step]} (no micro-step: -1):
# `msmon report` lays out its arrays from the footers instead of a scan of every row
SPANS_KEY = "msmon.spans"


def widened(have: list[int] | None, got: list[int]) -> list[int]:
    """A SPANS_KEY entry that covers both `have` (None: none yet) and `got`."""
    if have is None:
        return list(got)
    return [min(have[0], got[0]), max(have[1], got[1]), min(have[2], got[2]), max(have[3], got[3])]


# the columns of every file: `msmon db`'s long `metrics` table (offline/results/schema.py), with
# the run id first; DuckDB's types (the writer maps them to Arrow's)
COLUMNS = [
    ("run_id", "VARCHAR"),
    ("rank", "INTEGER"),
    ("vpp_stage", "INTEGER"),
    ("category", "VARCHAR"),
    ("name", "VARCHAR"),
    ("step", "BIGINT"),
    ("micro_step", "INTEGER"),
    ("op", "VARCHAR"),
    ("value", "DOUBLE"),
]
# every column but the value repeats a few distinct values row after row: dictionary-encoded
# (a name costs a few bits a row; the integers too, a sixth of the files' size)
DICTIONARY_COLUMNS = [name for name, _ in COLUMNS if name != "value"]
# min/max statistics for every column but the value: writers leave NaN out of a column's min and
# max, and readers then skip row groups that hold NaN (DuckDB's `WHERE isnan(value)` found none)
STATISTICS_COLUMNS = DICTIONARY_COLUMNS


def run_dir(output_base: str, run_id: str) -> str:
    """`<out>/parquet/run=<run id>`: one run's part of the dataset."""
    return os.path.join(output_base, PARQUET_DIR, f"{RUN_KEY}={run_id}")


def block_dir(output_base: str, run_id: str, rank: int) -> str:
    """The folder of `rank`'s files in the run: `.../run=<id>/rank_block=<first rank of its block>`."""
    return os.path.join(run_dir(output_base, run_id), f"{RANK_BLOCK_KEY}={rank // RANK_BLOCK * RANK_BLOCK}")


def file_name(rank: int, seq: int) -> str:
    """The name of `rank`'s `seq`-th file (PARQUET_FILE parses it back)."""
    return f"part-{rank:05d}-{seq:05d}.parquet"


def unfinished_name(rank: int, seq: int) -> str:
    """The name it has while it is written (UNFINISHED_FILE)."""
    return f".{file_name(rank, seq)}.tmp"


def rank_of_file(name: str) -> int | None:
    """The rank a file of the dataset (finished or not) belongs to, from its name."""
    match = PARQUET_FILE.match(name) or UNFINISHED_FILE.match(name)
    return int(match["rank"]) if match else None


def next_seq(directory: str, rank: int) -> int:
    """The first `seq` no file of `rank` in `directory` has (finished or not): a restarted
    writer, or a job restarted under the same run id, adds files and never replaces one."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    taken = [
        int(m["seq"])
        for m in (PARQUET_FILE.match(n) or UNFINISHED_FILE.match(n) for n in names)
        if m is not None and int(m["rank"]) == rank
    ]
    return max(taken, default=-1) + 1


def run_of(path: str) -> str | None:
    """The run id of a file of the dataset, from its `run=<id>` folder (None: not in one)."""
    run = os.path.basename(os.path.dirname(os.path.dirname(path)))
    prefix = f"{RUN_KEY}="
    return run[len(prefix) :] if run.startswith(prefix) else None

"""What a monitor output directory holds, found in one walk and classified by file name.

The layout (csv_sink, tensorboard_sink, anomaly/dump, monitor._write_summary):

    <out>/<time>-rank<r>-<uid>/{category}_{first}-{last}[_from{step}].csv
    <out>/<time>-rank<r>-<uid>/events.out.tfevents.*
    <out>/<time>-rank<r>-<uid>/summary.json, config.json
    <out>/anomaly_detected/rank<r>/anomaly.jsonl     (msprobe: anomaly.json)
    <out>/parquet/run=<id>/rank_block=<b>/part-<rank>-<seq>.parquet   (records/parquet_layout.py;
                                          `.part-*.parquet.tmp` while written: found, never read)

Directories are walked however deep (several nodes' outputs may be copied side by side). A
rank directory's rank is read from its name; a CSV or summary found elsewhere takes the rank
of summary.json beside it, when there is one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ...records.layout import CONFIG_FILE, CSV_FILE, DUMP_FILE, MSPROBE_DUMP_FILE, SUMMARY_FILE
from ...records.parquet_layout import PARQUET_FILE, UNFINISHED_FILE, rank_of_file

CSV, TENSORBOARD, SUMMARY, CONFIG, ANOMALIES = "csv", "tensorboard", "summary", "config", "anomalies"
PARQUET, UNFINISHED = "parquet", "parquet_unfinished"  # a closed Parquet file; one still written (or left by a kill)
# a rank's number in a directory name: msmon's (records/layout.py's RANK_DIR) and any other tool's
# `rank<r>` folder (msprobe's anomaly dumps, a hand-made layout), which msmon db also reads
RANK_IN_DIR = re.compile(r"(?:^|[-_])rank(\d+)(?:[-_]|$)")
TB_PREFIX = "events.out.tfevents."


@dataclass
class FoundFile:
    """One file worth loading, as seen on disk now."""

    path: str  # absolute
    kind: str  # csv | tensorboard | summary | config | anomalies | parquet | parquet_unfinished
    size: int
    mtime_ns: int
    rank_dir: str  # the directory holding it
    rank: int | None  # a Parquet file's from its name, the others' from their directory
    category: str | None = None


def classify(name: str) -> tuple[str, str | None] | None:
    """(kind, category) of a file name, or None for a file that is not loaded."""
    match = CSV_FILE.match(name)
    if match:
        return CSV, match["category"]
    if name.startswith(TB_PREFIX):
        return TENSORBOARD, None
    if name == SUMMARY_FILE:
        return SUMMARY, None
    if name == CONFIG_FILE:
        return CONFIG, None
    if name in (DUMP_FILE, MSPROBE_DUMP_FILE):
        return ANOMALIES, None
    if PARQUET_FILE.match(name):
        return PARQUET, None
    if UNFINISHED_FILE.match(name):
        return UNFINISHED, None
    return None


def rank_of_dir(directory: str) -> int | None:
    match = RANK_IN_DIR.search(os.path.basename(directory))
    if match:
        return int(match[1])
    try:
        with open(os.path.join(directory, SUMMARY_FILE), encoding="utf-8") as fh:
            rank = json.load(fh).get("rank")
        return rank if isinstance(rank, int) else None
    except (OSError, ValueError, AttributeError):
        return None


def has_output(root: str) -> bool:
    """Whether any file under `root` is one msmon writes (stops at the first: a real output
    folder answers at once)."""
    for _directory, _dirs, names in os.walk(root):
        if any(classify(name) is not None for name in names):
            return True
    return False


def scan(root: str) -> list[FoundFile]:
    """Every loadable file under `root`, in a stable order (directory, then name)."""
    found: list[FoundFile] = []
    stack = [os.path.abspath(root)]
    while stack:
        directory = stack.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            continue
        rank: int | None = None
        rank_known = False
        subdirs = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.path)
                continue
            kind = classify(entry.name)
            if kind is None or not entry.is_file():
                continue
            if kind[0] in (PARQUET, UNFINISHED):  # its folder is a block of ranks: the rank is in its name
                file_rank = rank_of_file(entry.name)
            else:
                if not rank_known:
                    rank, rank_known = rank_of_dir(directory), True
                file_rank = rank
            try:
                st = entry.stat()
            except OSError:
                continue
            found.append(FoundFile(entry.path, kind[0], st.st_size, st.st_mtime_ns, directory, file_rank, kind[1]))
        stack.extend(reversed(subdirs))
    return found

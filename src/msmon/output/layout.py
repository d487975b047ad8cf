"""The names of what msmon writes, in one torch-free place: the monitor writes them, and the
offline readers (`msmon analyse`, `msmon convert`, `msmon db`, the launcher's summary) find
them without importing torch."""

from __future__ import annotations

import re
import uuid
from datetime import datetime

from ..config.time_range import TIME_FORMAT

# a rank's output directory, `<local time %b%d_%H-%M-%S>-rank<r>-<short uid>`: the msprobe layout,
# written by rank_dir_name and parsed by RANK_DIR (append_output, msmon convert)
RANK_DIR = re.compile(r"^(?P<time>[A-Za-z]{3}\d{2}_\d{2}-\d{2}-\d{2})-rank(?P<rank>\d+)-")


def rank_dir_name(rank: int) -> str:
    """The name of a new output directory of `rank`, now: the name RANK_DIR parses back."""
    return f"{datetime.now().strftime(TIME_FORMAT)}-rank{rank}-{uuid.uuid4().hex[:8]}"


DUMP_DIR = "anomaly_detected"  # <out>/anomaly_detected/rank<r>/anomaly.jsonl
DUMP_FILE = "anomaly.jsonl"
MSPROBE_DUMP_FILE = "anomaly.json"  # msprobe's name, read as well
SUMMARY_FILE = "summary.json"  # per rank directory: what was recorded and what it cost
CONFIG_FILE = "config.json"  # per rank directory: the config in force
RUN_FILE = "run.json"  # per rank directory: the runs that wrote in it (output/runs.py)
# the CSV sink's files, one per category and window of steps: `{category}_{first}-{last}.csv`,
# and `..._from{start}.csv` when a category's columns changed at step `start` within a window
CSV_FILE = re.compile(
    r"^(?P<category>[A-Za-z][A-Za-z0-9_]*?)_(?P<first>\d+)-(?P<last>\d+)(?:_from(?P<start>\d+))?\.csv$"
)


def csv_file_name(category: str, first: int, last: int, start: int | None = None) -> str:
    """The CSV file of `category` for steps first..last (from step `start` on, when given): the
    name CSV_FILE parses back."""
    return f"{category}_{first}-{last}" + ("" if start is None else f"_from{start}") + ".csv"


def format_tag(display: str, rank: int, what: str) -> str:
    """A metric tag without the op, `{display}/rank{r}/{what}`: the one tag format (sinks append `_{op}`)."""
    return f"{display}/rank{rank}/{what}"

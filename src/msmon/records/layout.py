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
RUN_FILE = "run.json"  # per rank directory: the runs that wrote in it (records/runs.py)
INCIDENTS_FILE = "incidents.jsonl"  # <out>/incidents.jsonl: the stops alert.actions decided (records/incidents.py)
MEGATRON_SKIP_TRACKER = "result_rejected_tracker.txt"  # <out>/: skipped steps, Megatron's tracker lines
LIGHTNING_SKIP_BATCHES = "skip_batches.json"  # <out>/: skipped batches, Lightning's SpikeDetection list
# the CSV sink's files, one per category and window of steps: `{category}_{first}-{last}.csv`,
# and `..._from{start}.csv` when a category's columns changed at step `start` within a window
CSV_FILE = re.compile(
    r"^(?P<category>[A-Za-z][A-Za-z0-9_]*?)_(?P<first>\d+)-(?P<last>\d+)(?:_from(?P<start>\d+))?\.csv$"
)


def csv_file_name(category: str, first: int, last: int, start: int | None = None) -> str:
    """The CSV file of `category` for steps first..last (from step `start` on, when given): the
    name CSV_FILE parses back."""
    return f"{category}_{first}-{last}" + ("" if start is None else f"_from{start}") + ".csv"


def format_tag(display: str, rank: int | None, what: str) -> str:
    """A metric tag without the op, `{display}/rank{r}/{what}`: the one tag format (sinks append
    `_{op}`). `rank` None: the by_rank layout's `{display}/{what}`, the rank told by the run
    (the rank directory) instead, so that TensorBoard overlays the ranks of one tensor."""
    return f"{display}/{what}" if rank is None else f"{display}/rank{rank}/{what}"


def without_rank(tag: str, rank: int) -> str:
    """A tag made with `format_tag(display, rank, what)` in the by_rank layout: its `/rank{r}/`
    component removed (histogram and image tags, which collectors build with the rank)."""
    return tag.replace(f"/rank{rank}/", "/", 1)


# by_rank's summary lanes (tensorboard_sink): per category and op, the largest value over the
# step's tensors, `summary/{category}/{op}_max`, and one text table per step naming the tensor
# that holds each (SUMMARY_HOLDERS_TAG). Readers of tensor rows skip every tag under SUMMARY_ROOT.
SUMMARY_ROOT = "summary/"
SUMMARY_HOLDERS_TAG = "summary/max_holders"


def summary_tag(category: str, op: str) -> str:
    """The summary lane of `op` over the tensors of `category`: `summary/{category}/{op}_max`."""
    return f"{SUMMARY_ROOT}{category}/{op}_max"


def tag_with_rank(tag: str, rank: int) -> str:
    """A by_rank tag `{display}/{what}` with the rank its run stands for put back,
    `{display}/rank{r}/{what}`, the form the tag parsers read; a tag that has one is kept."""
    head, sep, last = tag.rpartition("/")
    if not sep or re.fullmatch(r"rank\d+", head.rpartition("/")[2]):
        return tag
    return f"{head}/rank{rank}/{last}"

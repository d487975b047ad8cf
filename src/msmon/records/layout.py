"""The names of what msmon writes, in one torch-free place: the monitor writes them, and the
offline readers (`msmon analyse`, `msmon convert`, `msmon db`, the launcher's summary) find
them without importing torch."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
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
    component removed (histogram and image tags, which collectors build with the rank). The last
    one: a module's own name may hold `/rank{r}/` too."""
    head, sep, tail = tag.rpartition(f"/rank{rank}/")
    return f"{head}/{tail}" if sep else tag


RANK_PART = re.compile(r"rank\d+")  # the rank component of a tag, `.../rank{r}/{what}`


def has_rank_part(tag: str) -> bool:
    """Whether `tag` reads as `{display}/rank{r}/{what}` (the default layout); a by_rank tag whose
    module name ends in `/rank{n}` reads so too, which is why readers ask `tags_by_rank`."""
    parts = tag.rsplit("/", 2)
    return len(parts) == 3 and bool(RANK_PART.fullmatch(parts[1]))


def tags_by_rank(tags: Iterable[str]) -> bool:
    """Whether the tags of one events file (or of one of its steps) are in the by_rank layout: a
    module name may hold `/`, even `/rank{n}`, so one tag cannot tell. The by_rank sink writes
    the summary lanes with every step's statistics; and in the default layout every tag has its
    rank component, so a file where none has is by_rank too (`msmon convert csv2tb --tags
    by_rank`, which writes no lanes)."""
    tags = list(tags)
    return any(t.startswith(SUMMARY_ROOT) for t in tags) or (bool(tags) and not any(map(has_rank_part, tags)))


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
    `{display}/rank{r}/{what}`, the form the tag parsers read. The caller knows the layout
    (`tags_by_rank`): a module name may end in `/rank{n}` itself."""
    head, sep, last = tag.rpartition("/")
    return f"{head}/rank{rank}/{last}" if sep else tag

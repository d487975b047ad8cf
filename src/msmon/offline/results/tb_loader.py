"""TensorBoard event files, read record by record (sinks/event_reader.py: a corrupt record is
skipped and counted, the rest of the file kept).

A scalar's tag is `{vpp}:{name}[:{micro}]/rank{r}/{category}_{op}` (tensorboard_sink); a
histogram's `{vpp}:{name}/rank{r}/{category}_hist`, its edges `[min] + bucket_limit`. In the
by_rank layout (tensorboard_layout) the tags have no `rank{r}/`: the rank is the directory's,
and the summary lanes (`summary/...`) are left out, being derived from the rows themselves. TensorBoard
keeps scalars as float32, so where a rank directory also has CSV files of a category, those
(rounded to `ndigits`, but from the float64 statistics) are the rows kept and the event file's
scalars of that category are left out, so no value is counted twice.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from ...records.layout import SUMMARY_ROOT, tag_with_rank, tags_by_rank
from ...records.rows import COLUMN_CATEGORIES
from ..analyse.reading import parse_tag
from ..event_reader import EventReader
from .schema import OPS

HIST_SUFFIX = "_hist"
# categories with their own columns, by the word their tags carry: word -> (category, columns)
_OWN_COLUMNS = {word: (category, columns) for category, (word, columns) in COLUMN_CATEGORIES.items()}


@dataclass
class EventRows:
    """What one pass over an event file gave."""

    events: int = 0  # events read (including the ones skipped as already loaded)
    scalars: list[tuple] = field(default_factory=list)  # (rank, vpp, category, name, step, micro, op, value)
    histograms: list[tuple] = field(default_factory=list)  # (rank, vpp, category, name, step, edges, counts)
    positions: dict[tuple[str, int, str], int] = field(default_factory=dict)  # (category, vpp, name): index in its step
    duplicates: int = 0  # scalars left out: the same category is in CSV files
    foreign: int = 0  # values whose tag is not msmon's
    lanes: int = 0  # values of the by_rank summary lanes, left out
    corrupt: int = 0  # records skipped: their checksum failed (sinks/event_reader.py)


def _parse(tag: str, rank: int | None = None) -> tuple[int, int, str, int | None, str, str] | None:
    """(rank, vpp, name, micro, category, op-or-'hist') of an msmon tag, or None; `rank`: the
    directory's, given for a by_rank tag, which has none (the file's layout: `tags_by_rank`)."""
    if rank is not None:
        tag = tag_with_rank(tag, rank)
    try:
        vpp, name, micro, task = parse_tag(tag)
        rank = int(tag.split("/")[-2][len("rank") :])
    except ValueError:
        return None
    if task.endswith(HIST_SUFFIX):
        return rank, vpp, name, micro, task[: -len(HIST_SUFFIX)], "hist"
    for word, (category, columns) in _OWN_COLUMNS.items():  # the loss, the L2 features, ...
        if task.startswith(word + "_") and task[len(word) + 1 :] in columns:
            return rank, vpp, name, micro, category, task[len(word) + 1 :]
    category, _, op = task.rpartition("_")
    if not category or op not in OPS:
        return None
    return rank, vpp, name, micro, category, op


def read_events(path: str, skip: int, csv_categories: Container[str], rank: int | None = None) -> EventRows:
    """Rows of the events after the first `skip` ones; scalars of `csv_categories` left out.
    `rank`: the rank directory's, the rank of by_rank tags."""
    out = EventRows()
    tags: dict[str, Any] = {}
    reader = EventReader(path)
    by_rank: bool | None = None  # the file's layout, told by its first step's tags (tags_by_rank)
    for index, event in enumerate(reader.events()):
        out.events = index + 1
        if not event.HasField("summary"):
            continue
        if by_rank is None:
            by_rank = tags_by_rank(value.tag for value in event.summary.value)
        if index < skip:
            continue
        step = event.step
        rows: dict[tuple, int] = {}  # this event's rows (category, vpp, name, micro): their index
        counts: dict[str, int] = {}  # rows of each category so far in this event
        for value in event.summary.value:
            parsed = tags.get(value.tag, False)
            if parsed is False:
                parsed = tags[value.tag] = (
                    None if value.tag.startswith(SUMMARY_ROOT) else _parse(value.tag, rank if by_rank else None)
                )
            if parsed is None and value.tag.startswith(SUMMARY_ROOT):
                out.lanes += 1
                continue
            if parsed is None:
                out.foreign += 1
                continue
            tag_rank, vpp, name, micro, category, op = parsed
            row = (category, vpp, name, micro)
            if row not in rows:
                rows[row] = counts.get(category, 0)
                counts[category] = rows[row] + 1
                key = (category, vpp, name)
                out.positions[key] = min(out.positions.get(key, rows[row]), rows[row])
            kind = value.WhichOneof("value")
            if kind == "simple_value" and op != "hist":
                if category in csv_categories:
                    out.duplicates += 1
                else:
                    out.scalars.append((tag_rank, vpp, category, name, step, micro, op, float(value.simple_value)))
            elif kind == "histo":
                histo = value.histo
                out.histograms.append(
                    (tag_rank, vpp, category, name, step, [histo.min, *histo.bucket_limit], list(histo.bucket))
                )
            else:
                out.foreign += 1
    out.corrupt = reader.skipped
    return out

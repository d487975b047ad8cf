"""Tags of converted values: msmon's live tags and msprobe's csv2tensorboard layout, written
and read back into the CSV row they stand for."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...records.layout import SUMMARY_ROOT, format_tag
from ...records.rows import COLLECTIVE_PHASES, OTHER, TENSOR_CATEGORIES, DirectionKey

# what the last part of a live tag, `{word}_{op}`, starts with: a category, mg_direction or a
# collective's phase; the longer words first, so that `exp_avg_sq_norm` is not exp_avg's `sq_norm`
TAG_WORDS = sorted((*TENSOR_CATEGORIES, DirectionKey.TASK, *COLLECTIVE_PHASES), key=len, reverse=True)
COLLECTIVE = re.compile(rf"^(?P<op>.+@.+)/(?P<phase>{'|'.join(COLLECTIVE_PHASES)})$")  # a collective's row name
# the live tag, `{display}/rank{r}/{last}`, or the by_rank layout's `{display}/{last}` (the rank is its run's)
MSMON_TAG = re.compile(r"^(?P<display>.+?)(?:/rank(?P<rank>\d+))?/(?P<last>[^/]+)$")
MSPROBE_TAG = re.compile(r"^vp(?P<vpp>\d+):(?P<rest>.+)/(?P<op>[^/]+)$")
LAYOUTS = ("msmon", "msprobe", "by_rank")  # by_rank: msmon's tags without the rank (tensorboard_layout)
META_KEY = "msmon"  # summary_description of a converted tag: its row, so reading it back needs no parsing


@dataclass(frozen=True)
class Row:
    category: str
    vpp_stage: str
    name: str
    micro_step: str  # "" when the row has none


def msmon_tag(row: Row, rank: int | None) -> str:
    """The live TensorBoard sink's tag of a CSV row, without `_{op}` (rank None: the by_rank layout's)."""
    if row.category == OTHER:
        collective = COLLECTIVE.match(row.name)
        if collective:
            return format_tag(collective["op"], rank, collective["phase"])
        return format_tag(f"{row.vpp_stage}:{row.name}", rank, DirectionKey.TASK)
    display = f"{row.vpp_stage}:{row.name}" + (f":{row.micro_step}" if row.micro_step != "" else "")
    return format_tag(display, rank, row.category)


def msprobe_tag(row: Row) -> str:
    """msprobe's csv2tensorboard tag, without `/{op}`."""
    return f"vp{row.vpp_stage}:{row.name}" + (f":micro{row.micro_step}" if row.micro_step != "" else "")


def parse_msmon_tag(tag: str) -> tuple[Row, str] | None:
    """(row, op) of a live msmon tag, in either tensorboard_layout; None for tags that are no
    statistic of a row (the by_rank summary lanes among them)."""
    if tag.startswith(SUMMARY_ROOT):
        return None
    match = MSMON_TAG.match(tag)
    if not match:
        return None
    display, last = match["display"], match["last"]
    task, op = _split_task(last)
    if op is None:
        return None
    if task in COLLECTIVE_PHASES and "@" in display:
        return Row(OTHER, "0", f"{display}/{task}", ""), op
    vpp, sep, rest = display.partition(":")
    if not sep or not vpp.isdigit():
        return None
    if task == DirectionKey.TASK:
        return Row(OTHER, vpp, rest, ""), op
    micro = ""
    head, sep, tail = rest.rpartition(":")
    if sep and tail.isdigit():
        rest, micro = head, tail
    return Row(task, vpp, rest, micro), op


def _split_task(last: str) -> tuple[str, str | None]:
    for category in TAG_WORDS:
        if last.startswith(category + "_") and len(last) > len(category) + 1:
            return category, last[len(category) + 1 :]
    task, sep, op = last.rpartition("_")
    return (task, op) if sep and task else (last, None)


def parse_msprobe_tag(tag: str, category: str) -> tuple[Row, str] | None:
    match = MSPROBE_TAG.match(tag)
    if not match:
        return None
    rest, micro = match["rest"], ""
    head, sep, tail = rest.rpartition(":micro")
    if sep and tail.isdigit():
        rest, micro = head, tail
    return Row(category, match["vpp"], rest, micro), match["op"]

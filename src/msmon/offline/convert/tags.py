"""Tags of converted values: msmon's live tags and msprobe's csv2tensorboard layout, written
and read back into the CSV row they stand for."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...records.layout import SUMMARY_ROOT, format_tag, has_rank_part
from ...records.rows import COLLECTIVE_PHASES, COLUMN_CATEGORIES, OTHER, TENSOR_CATEGORIES, DirectionKey

# what the last part of a live tag, `{word}_{op}`, starts with: a category, mg_direction or a
# collective's phase; the longer words first, so that `exp_avg_sq_norm` is not exp_avg's `sq_norm`
TAG_WORDS = sorted((*TENSOR_CATEGORIES, DirectionKey.TASK, *COLLECTIVE_PHASES), key=len, reverse=True)
# the categories with columns of their own (loss, grad_agreement, the L2 features), by the word
# their live tags carry: `{word}_{column}`, a column holding `_` too (`grad_agreement_norm_ratio`)
OWN_COLUMNS = {word: (category, columns) for category, (word, columns) in COLUMN_CATEGORIES.items()}
COLLECTIVE = re.compile(rf"^(?P<op>.+@.+)/(?P<phase>{'|'.join(COLLECTIVE_PHASES)})$")  # a collective's row name
# the live tag, `{display}/rank{r}/{last}` (display: a module name may hold `/`), or the by_rank
# layout's `{display}/{last}` (the rank is its run's)
RANKED_TAG = re.compile(r"^(?P<display>.+)/rank(?P<rank>\d+)/(?P<last>[^/]+)$")
BY_RANK_TAG = re.compile(r"^(?P<display>.+)/(?P<last>[^/]+)$")
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
    own = COLUMN_CATEGORIES.get(row.category)
    return format_tag(display, rank, own[0] if own else row.category)


def msprobe_tag(row: Row) -> str:
    """msprobe's csv2tensorboard tag, without `/{op}`."""
    return f"vp{row.vpp_stage}:{row.name}" + (f":micro{row.micro_step}" if row.micro_step != "" else "")


def parse_msmon_tag(tag: str, by_rank: bool | None = None) -> tuple[Row, str] | None:
    """(row, op) of a live msmon tag in the tensorboard_layout `by_rank` says (None: the tag's
    own look, `has_rank_part`, which a module name ending in `/rank{n}` misleads; readers that
    know the layout say it: records.layout.tags_by_rank); None for tags that are no statistic of
    a row (the by_rank summary lanes among them)."""
    if tag.startswith(SUMMARY_ROOT):
        return None
    if by_rank is None:
        by_rank = not has_rank_part(tag)
    match = (BY_RANK_TAG if by_rank else RANKED_TAG).match(tag)
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
    for word, (category, columns) in OWN_COLUMNS.items():
        if last.startswith(word + "_") and last[len(word) + 1 :] in columns:
            return category, last[len(word) + 1 :]
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

"""Reading the dumps: every rank's `anomaly.jsonl` (msmon) and `anomaly.json` (msprobe's
layout) under a directory, however deep. Bad input never stops the analysis: a file that
cannot be read or parsed is reported by name and skipped; in a .jsonl file each malformed line
(a torn last line after a crash, say) or record (a field of the wrong type) is reported,
counted and skipped, and the rest is kept."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...anomaly.event import NAN_ORIGIN_RULE, STAGES
from ...records.layout import DUMP_FILE, MSPROBE_DUMP_FILE
from ...records.rows import OPTIMIZER
from .events import STAGE_OF_CATEGORY, AnomalyEvent

_RECORD_ERRORS = (ValueError, TypeError, KeyError, AttributeError)
MAX_LINE_REPORTS = 5
_MSPROBE_MESSAGE = re.compile(
    r"Rule (?P<rule>\w+) reports anomaly signal in \('(?P<tag>[^']*)', '(?P<op>\w+)'\)"
    r"(?:.*?current value (?P<value>[^,\s]+?)(?=,|\.?$))?(?:.*?history mean (?P<history>[^,\s]+?))?\.?$"
)


@dataclass
class DumpSet:
    """Everything read under a directory: the events, the files, what was skipped and why."""

    events: list[AnomalyEvent] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped_records: int = 0  # malformed lines and records left out


# -- reading ------------------------------------------------------------------------------------
def find_dump_files(directory: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            if name in (DUMP_FILE, MSPROBE_DUMP_FILE):
                found.append(os.path.join(root, name))
    return found


def read_dumps(directory: str) -> DumpSet:
    """Read every dump under `directory`; problems are collected, never raised."""
    return read_dump_files(find_dump_files(directory))


def read_dump_files(paths: Iterable[str]) -> DumpSet:
    """Read the given dump files (msmon's .jsonl or msprobe's .json, by name), as read_dumps
    does for a directory: the database loader (msmon.offline.results) reads them this way too."""
    result = DumpSet()
    seen: set[tuple] = set()
    for path in paths:
        result.files.append(path)
        reader = _read_jsonl if path.endswith(".jsonl") else _read_msprobe_json
        for event in reader(path, result):
            identity = (
                event.rank,
                event.step,
                event.micro_step,
                event.stage,
                event.call_id,
                event.tag,
                event.name,
                event.category,
                event.op,
                event.rule,
                repr(event.value),
                event.run_id,  # two runs of a deterministic job write the same records
            )
            if identity not in seen:  # the same node's directory copied in twice
                seen.add(identity)
                result.events.append(event)
    _align_origins(result.events)
    return result


def _align_origins(events: list[AnomalyEvent]) -> None:
    """Give each NanOrigin record the call_id of the alert on the same tensor, when there is
    one: the origin detector numbers its flags apart from the statistic rows, and only the
    rows' numbers compare with the other alerts of the step."""
    rows: dict[tuple, int] = {}
    for e in events:
        if e.rule != NAN_ORIGIN_RULE:
            ident = (e.rank, e.step, e.micro_step, e.stage, e.category, e.name)
            rows[ident] = min(rows.get(ident, e.call_id), e.call_id)
    for e in events:
        if e.rule == NAN_ORIGIN_RULE:
            e.call_id = rows.get((e.rank, e.step, e.micro_step, e.stage, e.category, e.name), e.call_id)


def _read_jsonl(path: str, result: DumpSet) -> Iterable[AnomalyEvent]:
    problems = result.problems
    bad_lines = 0
    last_step: dict[str | None, int] = {}  # per run: the records of several runs interleave in one file
    try:
        fh = open(path, encoding="utf-8", errors="replace")
    except OSError as exc:
        problems.append(f"{path}: cannot be read ({exc.strerror or exc}); skipped")
        return
    with fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                event = event_from_record(record, path)
            except _RECORD_ERRORS as exc:
                bad_lines += 1
                result.skipped_records += 1
                if bad_lines <= MAX_LINE_REPORTS:
                    reason = (
                        "not valid JSON (a torn or truncated line?)"
                        if isinstance(exc, json.JSONDecodeError)
                        else str(exc)
                    )
                    problems.append(f"{path} line {number}: {reason}; line skipped")
                continue
            if event.rule != NAN_ORIGIN_RULE:
                previous = last_step.get(event.run_id)
                if previous is not None and event.step < previous:
                    problems.append(
                        f"{path} line {number}: the step goes back from {previous} to {event.step}: "
                        + (
                            "the file holds records of more than one run without a run id (they are read as one run)"
                            if event.run_id is None
                            else f"run {event.run_id} started again from an earlier step (resumed, same id?)"
                        )
                    )
                last_step[event.run_id] = event.step
            yield event
    if bad_lines > MAX_LINE_REPORTS:
        problems.append(f"{path}: {bad_lines - MAX_LINE_REPORTS} more malformed lines skipped")


def _read_msprobe_json(path: str, result: DumpSet) -> Iterable[AnomalyEvent]:
    problems = result.problems
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        problems.append(f"{path}: cannot be read ({exc.strerror or exc}); skipped")
        return
    except (ValueError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: not valid JSON ({exc}); file skipped")
        return
    if not isinstance(data, dict):
        problems.append(f"{path}: expected msprobe's layout {{key: record}}, got {type(data).__name__}; file skipped")
        return
    for key, record in data.items():
        try:
            event = event_from_msprobe(record, path)
        except _RECORD_ERRORS as exc:
            result.skipped_records += 1
            problems.append(f"{path} record {key!r}: {exc}; record skipped")
            continue
        yield event


def _optional_int(record: dict, key: str) -> int | None:
    """An integer field, or None when absent or null; anything else makes the record malformed."""
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    return value


def _int(record: dict, key: str, default: int) -> int:
    value = _optional_int(record, key)
    return default if value is None else value


def _required_int(record: dict, key: str) -> int:
    value = _optional_int(record, key)
    if value is None:
        raise ValueError(f"missing {key!r}")
    return value


def _text(record: dict, key: str) -> str | None:
    """A string field, or absent (None); anything else makes the record malformed."""
    value = record.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {value!r}")
    return value


def _float(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value)  # "nan", "inf", "-inf", or a number written as text
    raise ValueError(f"expected a number, got {value!r}")


def parse_tag(tag: str) -> tuple[int, str, int | None, str]:
    """(vpp_stage, name, micro_step, category) of `{vpp}:{name}[:{micro}]/rank{r}/{category}`."""
    parts = tag.split("/")
    if len(parts) < 3 or not parts[-2].startswith("rank"):
        raise ValueError(f"tag {tag!r} is not of the form '{{vpp}}:{{name}}/rank{{r}}/{{task}}'")
    category, display = parts[-1], "/".join(parts[:-2])
    vpp, micro = 0, None
    head = re.match(r"(\d+):(.*)", display)
    if head:
        vpp, display = int(head[1]), head[2]
    tail = re.fullmatch(r"(.*):(\d+)", display)
    if tail:
        display, micro = tail[1], int(tail[2])
    return vpp, display, micro, category


def event_from_record(record: Any, path: str = "") -> AnomalyEvent:
    """An event from one msmon anomaly.jsonl record."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    for key in ("tag", "name", "category", "stage", "op", "rule", "message"):
        _text(record, key)
    tag = record.get("tag") or ""
    name, category = record.get("name"), record.get("category")
    vpp = _optional_int(record, "vpp_stage")
    micro = _optional_int(record, "micro_step")
    if (name is None or category is None) and tag:
        tag_vpp, tag_name, tag_micro, tag_category = parse_tag(tag)
        name, category = name or tag_name, category or tag_category
        vpp = tag_vpp if vpp is None else vpp
        micro = tag_micro if micro is None else micro
    if not isinstance(name, str) or not isinstance(category, str):
        raise ValueError("missing 'name' and 'category' (or a 'tag' to read them from)")
    stage = record.get("stage") or STAGE_OF_CATEGORY.get(category, OPTIMIZER)
    if stage not in STAGES:
        raise ValueError(f"'stage' must be one of {list(STAGES)}, got {stage!r}")
    mates = record.get("group_mates") or []
    return AnomalyEvent(
        rank=_required_int(record, "rank"),
        step=_required_int(record, "step"),
        micro_step=micro,
        pp_stage=_int(record, "pp_stage", 0),
        vpp_stage=vpp or 0,
        stage=stage,
        call_id=_int(record, "call_id", -1),
        name=name,
        category=category,
        tag=tag,
        op=record.get("op"),
        value=_float(record.get("value")),
        history=_float(record.get("history")),
        rule=str(record.get("rule") or ""),
        message=str(record.get("message") or ""),
        group_mates=[m for m in mates if isinstance(m, int)] if isinstance(mates, list) else [],
        file=path,
        run_id=record["run_id"] if isinstance(record.get("run_id"), str) else None,
    )


def event_from_msprobe(record: Any, path: str = "") -> AnomalyEvent:
    """An event from one record of msprobe's anomaly.json ({key: GradAnomalyData fields}).

    msprobe wrote micro_step 0 for everything; the micro-step in the tag
    (`0:fc2.output:3/rank0/actv`) is used instead when there is one. Op, value and history
    are read back from msprobe's message text.
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    tag = record.get("tag_name")
    if not isinstance(tag, str):
        raise ValueError("missing 'tag_name'")
    _text(record, "message")
    vpp, name, tag_micro, category = parse_tag(tag)
    message = str(record.get("message") or "")
    parsed = _MSPROBE_MESSAGE.search(message)
    op = value = history = None
    rule = "msprobe"
    if parsed:
        rule, op = parsed["rule"], parsed["op"]
        value = _float_or_none(parsed["value"])
        history = _float_or_none(parsed["history"])
    micro = tag_micro if tag_micro is not None else None
    mates = record.get("group_mates") or []
    return AnomalyEvent(
        rank=_required_int(record, "rank"),
        step=_required_int(record, "step"),
        micro_step=micro,
        pp_stage=_int(record, "pp_stage", 0),
        vpp_stage=_int(record, "vpp_stage", vpp),
        stage=STAGE_OF_CATEGORY.get(category, OPTIMIZER),
        call_id=_int(record, "call_id", -1),
        name=name,
        category=category,
        tag=tag,
        op=op,
        value=value,
        history=history,
        rule=rule,
        message=message,
        group_mates=[m for m in mates if isinstance(m, int)] if isinstance(mates, list) else [],
        file=path,
    )


def _float_or_none(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None

"""`msmon analyse`: where did it start? Orders every rank's anomalies in training time.

Reads each `anomaly.jsonl` (msmon) and `anomaly.json` (msprobe's layout) found under a
directory, however deep (several nodes' output directories may be copied into one), and sorts
the events by

    step, micro-step, stage (forward < backward < optimizer), pipeline position, call_id, rank

where the pipeline position is (vpp_stage, pp_stage) ascending in forward, descending in
backward (the last stage runs its backward first), and ascending in the optimizer (all stages
step together: the order there is only a stable tie-break). An event that covers the whole
step (micro_step null: accumulated gradients, optimizer state) sorts after every micro-step of
its step. The first event, the first one on each rank, and the first non-finite origin
(records of rule NanOrigin) make the verdict.

Bad input never stops the analysis: a file that cannot be read or parsed is reported by name
and skipped; in a .jsonl file each malformed line (a torn last line after a crash, say) or
record (a field of the wrong type) is reported, counted and skipped, and the rest is kept.

Two files are written: msmon's report (the verdict, the first anomaly per rank, ...) and
msprobe's `anomaly_analyse.json` (msprobe_format), beside it.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..anomaly.event import NAN_ORIGIN_RULE, REPLICA_RULE, STAGES, json_number
from ..output.layout import DUMP_FILE, MSPROBE_DUMP_FILE
from ..output.records import (
    BACKWARD,
    CATEGORY_STAGE,
    CATEGORY_TEXT,
    FORWARD,
    LOSS,
    MSPROBE_GRAD_STAGE,
    OPTIMIZER,
)
from .msprobe_format import MSPROBE_ANALYSE_FILE, msprobe_records

REPORT_FILE = "msmon_analyse.json"  # msmon's report; msprobe's layout is MSPROBE_ANALYSE_FILE
_RECORD_ERRORS = (ValueError, TypeError, KeyError, AttributeError)
STAGE_ORDER = {stage: i for i, stage in enumerate(STAGES)}
# msprobe's task names too, mapped to the training stage they happen in (msprobe ranked unknown
# tasks such as parameters first of all; here every task has its real place)
STAGE_OF_CATEGORY = {**CATEGORY_STAGE, **MSPROBE_GRAD_STAGE}
MAX_LINE_REPORTS = 5
_MSPROBE_MESSAGE = re.compile(
    r"Rule (?P<rule>\w+) reports anomaly signal in \('(?P<tag>[^']*)', '(?P<op>\w+)'\)"
    r"(?:.*?current value (?P<value>[^,\s]+?)(?=,|\.?$))?(?:.*?history mean (?P<history>[^,\s]+?))?\.?$"
)


@dataclass
class AnomalyEvent:
    """One anomaly of one rank, as read from a dump, normalised across both layouts."""

    rank: int
    step: int
    micro_step: int | None
    pp_stage: int
    vpp_stage: int
    stage: str
    call_id: int
    name: str
    category: str
    tag: str = ""
    op: str | None = None
    value: float | None = None
    history: float | None = None
    rule: str = ""
    message: str = ""
    group_mates: list[int] = field(default_factory=list)
    file: str = ""

    def order_key(self) -> tuple:
        micro = self.micro_step if self.micro_step is not None else math.inf
        stage = STAGE_ORDER.get(self.stage, len(STAGE_ORDER))
        position = (-self.vpp_stage, -self.pp_stage) if self.stage == BACKWARD else (self.vpp_stage, self.pp_stage)
        origin_first = 0 if self.rule == NAN_ORIGIN_RULE else 1
        return (self.step, micro, stage, *position, self.call_id, origin_first, self.rank)

    def where(self) -> str:
        micro = f", micro-step {self.micro_step}" if self.micro_step is not None else ""
        return f"rank {self.rank}, step {self.step}{micro}"

    def what(self) -> str:
        """In words, e.g. "forward output of layers.1.fc2" or "reduced gradient of fc1.weight"."""
        module, slot = _split_slot(self.name)
        if self.category == "actv_grad" and self.name == LOSS:
            return "gradient of the loss"
        if self.category == "actv" and slot:
            return f"forward {slot} of {module}"
        if self.category == "actv_grad" and slot:
            return f"backward {slot.replace('_grad', '')} gradient of {module}"
        if self.category in CATEGORY_TEXT:
            return CATEGORY_TEXT[self.category].format(self.name)
        return f"{self.stage} {self.category} {self.name}"

    def symptom(self) -> str:
        if self.rule == NAN_ORIGIN_RULE:
            return "first non-finite"
        if self.rule == REPLICA_RULE:
            return "copies differ across data-parallel replicas"
        if self.op == "nans" or (self.value is not None and math.isnan(self.value)):
            return "nans"
        if self.op == "infs" or (self.value is not None and math.isinf(self.value)):
            return "inf"
        if self.rule == "AnomalyTurbulence" and self.value is not None and self.history:
            return f"|{self.op}| {abs(self.value) / self.history:.3g}x its history"
        if self.op is not None and self.value is not None:
            return f"{self.op}={self.value:.6g}"
        return self.rule or "anomaly"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["value"] = json_number(self.value)
        out["history"] = json_number(self.history)
        out["description"] = f"{self.where()}, {self.stage}: {self.what()} ({self.symptom()})"
        return out


def _split_slot(name: str) -> tuple[str, str | None]:
    """("layers.1.fc2", "output") from "layers.1.fc2.output" (also .input_0, .output_grad)."""
    match = re.fullmatch(r"(?P<module>.+)\.(?P<slot>input|output)(?P<grad>_grad)?(?:_\d+)?", name)
    if not match:
        return name, None
    return match["module"], match["slot"] + (match["grad"] or "")


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
    does for a directory: the database loader (msmon.results) reads them this way too."""
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
    last_step: int | None = None
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
                if last_step is not None and event.step < last_step:
                    problems.append(
                        f"{path} line {number}: the step goes back from {last_step} to {event.step}: "
                        "the file holds more than one run (all are analysed together)"
                    )
                last_step = event.step
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
    if stage not in STAGE_ORDER:
        raise ValueError(f"'stage' must be one of {list(STAGE_ORDER)}, got {stage!r}")
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


# -- ordering and the verdict -------------------------------------------------------------------
def order_events(events: Iterable[AnomalyEvent]) -> list[AnomalyEvent]:
    return sorted(events, key=AnomalyEvent.order_key)


def first_per_rank(ordered: list[AnomalyEvent]) -> dict[int, AnomalyEvent]:
    firsts: dict[int, AnomalyEvent] = {}
    for event in ordered:
        firsts.setdefault(event.rank, event)
    return firsts


def _same_tensor(a: AnomalyEvent, b: AnomalyEvent) -> bool:
    return (a.rank, a.step, a.micro_step, a.stage, a.category, a.name) == (
        b.rank,
        b.step,
        b.micro_step,
        b.stage,
        b.category,
        b.name,
    )


def verdict(ordered: list[AnomalyEvent]) -> str:
    """One paragraph: the first anomaly, how far it spread, the first non-finite origin."""
    if not ordered:
        return "No anomaly recorded."
    first = ordered[0]
    # a NanOrigin record says where; the alert on the same tensor says what was wrong with it
    shown = next((e for e in ordered if e.rule != NAN_ORIGIN_RULE and _same_tensor(e, first)), first)
    firsts = first_per_rank(ordered)
    steps = sorted({e.step for e in ordered})
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    parts = [f"First anomaly: {first.where()}, {first.what()} ({shown.symptom()}; {shown.rule or 'rule unknown'})."]
    same_time = [r for r, e in firsts.items() if r != first.rank and e.order_key()[:5] == first.order_key()[:5]]
    if same_time:
        parts.append(
            f"At the same point of the step (same micro-step, stage and pipeline stage) it also shows on "
            f"rank{'s' if len(same_time) > 1 else ''} {_ranks(same_time)}."
        )
    parts.append(
        f"{len(ordered)} anomal{'y' if len(ordered) == 1 else 'ies'} in all, on "
        f"{len(firsts)} rank{'s' if len(firsts) != 1 else ''}, in {span}."
    )
    later = [e for r, e in sorted(firsts.items()) if r != first.rank and r not in same_time]
    if later:
        listed = "; ".join(f"rank {e.rank} at step {e.step} {e.stage} ({e.what()})" for e in later[:3])
        more = f"; and {len(later) - 3} more ranks" if len(later) > 3 else ""
        parts.append(f"Other ranks' first anomalies came later: {listed}{more}.")
    origin = next((e for e in ordered if e.rule == NAN_ORIGIN_RULE), None)
    if origin is not None:
        slot = _split_slot(origin.name)[1]
        if origin.stage == FORWARD and slot == "input":
            why = (
                "the value was already non-finite when it reached this module (made outside any module, or by the data)"
            )
        elif origin.name == LOSS:
            why = "the loss, computed outside any module, sent a non-finite gradient back into the model"
        elif origin.category == "grad_reduced":
            why = (
                "it was non-finite as the optimizer got it while every activation gradient was finite "
                "(a tensor hook, a write into .grad, or another rank's gradient through the all-reduce)"
            )
        elif origin.stage == BACKWARD and slot == "output":
            why = (
                "the gradient was already non-finite when it reached this module "
                "(made outside any module: a tensor hook, or code between modules)"
            )
        else:
            feeds = "output" if origin.stage == FORWARD else "input gradient"
            why = f"the first module whose {feeds} was non-finite while everything that fed it was finite"
        if origin is first:
            parts.append(f"That is the first non-finite origin: {why}.")
        else:
            parts.append(f"First non-finite origin: {origin.where()}, {origin.what()}: {why}.")
    replicas = [e for e in ordered if e.rule == REPLICA_RULE]
    if replicas:
        parts.append(_replica_sentence(replicas))
    return " ".join(parts)


def _replica_sentence(events: list[AnomalyEvent]) -> str:
    """The first replica check that found data-parallel copies differing: which tensors, whose copy."""
    step = events[0].step
    at_step = [e for e in events if e.step == step]
    names = list(dict.fromkeys(e.name for e in at_step))
    ranks = sorted({e.rank for e in at_step})
    detail = events[0].message.removeprefix("replica check: ")
    more = (
        f" ({len(names)} tensors in all: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
        if len(names) > 1
        else ""
    )
    return (
        f"Data-parallel replicas diverged: the replica check of step {step} found {detail}{more}; "
        f"the copies on rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} are suspect (silent data corruption, "
        f"or an update or reduction that did not happen alike everywhere)."
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in sorted(ranks)[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def format_table(events: list[AnomalyEvent]) -> str:
    header = ("#", "rank", "step", "micro", "stage", "pp", "vpp", "call", "rule", "tensor", "op", "value", "history")
    rows = [header]
    for i, e in enumerate(events):
        rows.append(
            (
                str(i),
                str(e.rank),
                str(e.step),
                "-" if e.micro_step is None else str(e.micro_step),
                e.stage,
                str(e.pp_stage),
                str(e.vpp_stage),
                str(e.call_id),
                e.rule,
                f"{e.name} ({e.category})",
                e.op or "-",
                _num(e.value),
                _num(e.history),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


# -- the command --------------------------------------------------------------------------------
def output_paths(directory: str, output: str | None) -> tuple[str, str]:
    """(msmon's report, msprobe's anomaly_analyse.json). Both go into OUT when it is a
    directory (or ends with a separator), into DIR without -o, as msprobe's analyser does;
    when OUT names a file, that file is the report and msprobe's file goes beside it (unless
    OUT is itself named anomaly_analyse.json: then that is msprobe's, and the report beside)."""
    if not output or os.path.isdir(output) or output.endswith(("/", os.sep)):
        folder = output or directory
        return os.path.join(folder, REPORT_FILE), os.path.join(folder, MSPROBE_ANALYSE_FILE)
    folder = os.path.dirname(output)
    if os.path.basename(output) == MSPROBE_ANALYSE_FILE:
        return os.path.join(folder, REPORT_FILE), output
    return output, os.path.join(folder, MSPROBE_ANALYSE_FILE)


def _write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, allow_nan=False)
    os.replace(tmp, path)


def run_analyse(directory: str, output: str | None = None, top_k: int = 8, steps: list[int] | None = None) -> int:
    """Read every rank's anomaly dump under `directory`, print the first `top_k` anomalies in
    training order and a verdict, and write msmon's report and msprobe's anomaly_analyse.json
    where `output_paths` says. Returns the exit code: 0 on success, 1 when there is nothing to
    analyse or the result cannot be written, 2 for a bad argument."""
    err = sys.stderr
    if top_k < 1:
        print(f"msmon analyse: -k must be at least 1, got {top_k}", file=err)
        return 2
    if not os.path.isdir(directory):
        print(
            f"msmon analyse: {directory} is not a directory (expected $MONITOR_OUTPUT_DIR/anomaly_detected "
            "or a folder that holds rank*/anomaly.jsonl)",
            file=err,
        )
        return 1
    dumps = read_dumps(directory)
    for problem in dumps.problems:
        print(f"msmon analyse: {problem}", file=err)
    if dumps.skipped_records:
        print(
            f"msmon analyse: skipped {dumps.skipped_records} malformed record{'s' if dumps.skipped_records > 1 else ''}",  # noqa: E501
            file=err,
        )
    if not dumps.files:
        print(
            f"msmon analyse: no anomaly dump under {directory}: no rank*/{DUMP_FILE} (nor msprobe's "
            f"{MSPROBE_DUMP_FILE}). Was alert.dump true and did any alert fire?",
            file=err,
        )
        return 1
    if not dumps.events:
        print(
            f"msmon analyse: {len(dumps.files)} dump file(s) under {directory}, but no readable anomaly record",
            file=err,
        )
        return 1
    ordered = order_events(dumps.events)
    wanted = set(steps or ())
    selected = [e for e in ordered if e.step in wanted] if steps else ordered
    if steps and not selected:
        all_steps = sorted({e.step for e in ordered})
        print(
            f"No anomaly in step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}; anomalies were "
            f"recorded in steps {all_steps[0]}-{all_steps[-1]} ({len(all_steps)} distinct)."
        )
    top = selected[:top_k]
    text = verdict(selected) if selected else "No anomaly in the selected steps."
    if top:
        print(f"The first {len(top)} of {len(selected)} anomalies, in training order:")
        print(format_table(top))
        print()
    print(text)
    origins = [e for e in selected if e.rule == NAN_ORIGIN_RULE]
    result = {
        "directory": os.path.abspath(directory),
        "files": dumps.files,
        "skipped": dumps.problems,
        "skipped_records": dumps.skipped_records,
        "steps": list(steps) if steps else None,
        "total": len(selected),
        "ranks": sorted({e.rank for e in selected}),
        "verdict": text,
        "first_anomaly": selected[0].to_json() if selected else None,
        "nan_origin": origins[0].to_json() if origins else None,
        "first_per_rank": {str(r): e.to_json() for r, e in sorted(first_per_rank(selected).items())},
        "top_k": [e.to_json() for e in top],
    }
    report, msprobe = output_paths(directory, output)
    for path, data in ((report, result), (msprobe, msprobe_records(top))):
        try:
            _write_json(path, data)
        except OSError as exc:
            print(f"msmon analyse: cannot write {path}: {exc.strerror or exc}", file=err)
            return 1
    print(f"Written to {report} (and msprobe's layout to {msprobe})")
    return 0

"""msprobe's `anomaly_analyse.json`, for scripts written against the reference tool.

The reference analyser writes the first `k` anomalies in its order as one JSON object,
`{"<tag_name>_step_<step>_call_<call_id>": {rank, step, micro_step, pp_stage, vpp_stage,
call_id, tag_name, message, group_mates}}`, into its output directory. msmon writes the same
layout, with msmon's order (the object's key order) and msprobe's message text, so a script
that parses it (rule, tag, op, current value, history mean) keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ...records.layout import MSPROBE_DUMP_FILE

if TYPE_CHECKING:
    from .events import AnomalyEvent

MSPROBE_ANALYSE_FILE = "anomaly_analyse.json"


def msprobe_records(events: Iterable[AnomalyEvent]) -> dict[str, dict[str, Any]]:
    """The events, in the order given, as msprobe's GradAnomalyData records."""
    out: dict[str, dict[str, Any]] = {}
    for event in events:
        tag = event.tag or _tag(event)
        key = base = f"{tag}_step_{event.step}_call_{event.call_id}"
        if key in out:  # msprobe lost such records (two rules on one tensor); msmon keeps them
            key = f"{base}_{event.rule}"
            n = 2
            while key in out:
                key, n = f"{base}_{event.rule}_{n}", n + 1
        out[key] = {
            "rank": event.rank,
            "step": event.step,
            "micro_step": event.micro_step if event.micro_step is not None else 0,  # msprobe's int, 0 for whole-step
            "pp_stage": event.pp_stage,
            "vpp_stage": event.vpp_stage,
            "call_id": event.call_id,
            "tag_name": tag,
            "message": _message(event, tag),
            "group_mates": list(event.group_mates),
        }
    return out


def _tag(event: AnomalyEvent) -> str:
    micro = f":{event.micro_step}" if event.micro_step is not None else ""
    return f"{event.vpp_stage}:{event.name}{micro}/rank{event.rank}/{event.category}"


def _message(event: AnomalyEvent, tag: str) -> str:
    """msprobe's own text for a record read from msprobe's dump; else its form, from the fields."""
    if event.file.endswith(MSPROBE_DUMP_FILE) and event.message:
        return event.message
    text = f"Rule {event.rule or 'unknown'} reports anomaly signal in ('{tag}', '{event.op or 'unknown'}') at step {event.step}"  # noqa: E501
    if event.value is not None:
        text += f", current value {_number(event.value)}"
    if event.history is not None:
        text += f", history mean {_number(event.history)}"
    return text + "."


def _number(value: float) -> str:
    return repr(float(value))  # as msprobe printed its floats: 0.5, 1e-08, nan, inf

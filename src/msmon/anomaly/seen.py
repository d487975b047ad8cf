"""What one rank saw at a step, as the step's vote carries it to the other ranks (torch-free).

An alert of any rule (a row rule's, the non-finite origin, the rank-outlier rule's, the replica
check's) becomes one `Seen`: the fields of its anomaly-dump record (anomaly/event.py) that place
it on the step's data path, name the tensor and say what happened. The vote
(runtime/actions/) gathers every rank's, and the decision reads them: which rules alerted, and
the kind of fault, told by anomaly/fault_kind.py's `classify` from their `PathEvent`s, the same
function `msmon analyse` calls on the dump, so the decision taken online and the analysis
afterwards agree. Small and picklable: it travels in one object gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..records.rows import RowKey
from .data_path import PathEvent, describe_tensor


class Alert(Protocol):
    """What `from_alert` reads of a rule's alert (anomaly/rules.py's Alert; named here by its
    fields, since the rules module imports torch and this one must not)."""

    key: RowKey
    call_id: int
    op: str
    value: float
    rule: str
    message: str


@dataclass(frozen=True)
class Seen:
    """One alert of one rank at one step."""

    rank: int
    step: int
    rule: str
    category: str
    name: str
    stage: str = ""
    micro_step: int | None = None
    call_id: int = -1
    vpp_stage: int = 0
    pp_stage: int = 0
    op: str = ""
    value: float = math.nan
    message: str = ""
    host: str = ""  # the rank's host, filled in by the vote

    def path_event(self) -> PathEvent:
        return PathEvent.of(self)

    @property
    def tensor(self) -> tuple[str, str, int]:
        """Which tensor, whatever the rank: (category, name, vpp stage)."""
        return self.category, self.name, self.vpp_stage

    def what(self) -> str:
        return describe_tensor(self.category, self.name, self.stage)

    def on_host(self, host: str) -> Seen:
        return replace(self, host=host)


def from_alert(rank: int, step: int, alert: Alert, pp_stage: int = 0) -> Seen:
    key = alert.key
    return Seen(
        rank,
        step,
        alert.rule,
        key.category,
        key.name,
        key.train_stage,
        key.micro_step,
        alert.call_id,
        key.vpp_stage,
        pp_stage,
        alert.op,
        float(alert.value),
        alert.message,
    )


def from_record(record: dict[str, Any]) -> Seen:
    """A dump record (anomaly/dump.py's fields), as the rank-outlier rule and the replica check
    write them."""
    value = record.get("value")
    try:
        number = float(value) if value is not None else math.nan
    except (TypeError, ValueError):
        number = math.nan
    return Seen(
        int(record["rank"]),
        int(record["step"]),
        str(record["rule"]),
        str(record["category"]),
        str(record["name"]),
        str(record.get("stage") or ""),
        record.get("micro_step"),
        int(record.get("call_id", -1)),
        int(record.get("vpp_stage") or 0),
        int(record.get("pp_stage") or 0),
        str(record.get("op") or ""),
        number,
        str(record.get("message") or ""),
    )

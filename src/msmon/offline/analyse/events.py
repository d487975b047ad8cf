"""An anomaly as `msmon analyse` sees it: one rank's record, normalised across msmon's and
msprobe's dumps, with its place in training time and its description in words."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ...anomaly.data_path import PathEvent, describe_tensor, split_slot
from ...anomaly.event import NAN_ORIGIN_RULE, RANK_OUTLIER_RULE, REPLICA_RULE, json_number
from ...records.rows import CATEGORY_STAGE, MSPROBE_GRAD_STAGE

__all__ = ["STAGE_OF_CATEGORY", "AnomalyEvent", "split_slot"]

# msprobe's task names too, mapped to the training stage they happen in (msprobe ranked unknown
# tasks such as parameters first of all; here every task has its real place)
STAGE_OF_CATEGORY = {**CATEGORY_STAGE, **MSPROBE_GRAD_STAGE}


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
    run_id: str | None = None  # the run that wrote it (records/runs.py); None: a dump without run ids

    def path_event(self) -> PathEvent:
        """Its place on the step's data path (anomaly/data_path.py)."""
        return PathEvent.of(self)

    def order_key(self) -> tuple:
        """Training order: the step, then where it arose on the data path (micro-step, forward
        activations, the loss, activation gradients, rank-local gradients, the reduction, the
        optimizer state, the weights; the pipeline position; the call), a NanOrigin before the
        alert on its tensor, and the rank."""
        return (self.step, *self.path_event().position())

    def where(self) -> str:
        micro = f", micro-step {self.micro_step}" if self.micro_step is not None else ""
        return f"rank {self.rank}, step {self.step}{micro}"

    def what(self) -> str:
        """In words, e.g. "forward output of layers.1.fc2" or "reduced gradient of fc1.weight"."""
        return describe_tensor(self.category, self.name, self.stage)

    def symptom(self) -> str:
        if self.rule == NAN_ORIGIN_RULE:  # which value, where the record says (older dumps: op "nonfinite")
            known = self.op not in (None, "nonfinite") and self.value is not None
            return f"first non-finite, {self.op}={self.value:g}" if known else "first non-finite"
        if self.rule == REPLICA_RULE:
            return "copies differ across data-parallel replicas"
        if self.op == "nans" or (self.value is not None and math.isnan(self.value)):
            return "nans"
        if self.op == "infs" or (self.value is not None and math.isinf(self.value)):
            return "inf"
        if self.rule == RANK_OUTLIER_RULE and self.message.startswith("rank "):
            return self.message.split(" (", 1)[0]  # "rank 2's activation norm 813 is 268 robust deviations ..."
        if self.rule == RANK_OUTLIER_RULE and self.value is not None and self.history is not None:
            return f"the rank's {self.op} {self.value:.6g}, the ranks' median {self.history:.6g}"
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

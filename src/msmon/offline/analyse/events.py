"""An anomaly as `msmon analyse` sees it: one rank's record, normalised across msmon's and
msprobe's dumps, with its place in training time and its description in words."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ...anomaly.event import NAN_ORIGIN_RULE, RANK_OUTLIER_RULE, REPLICA_RULE, STAGES, json_number
from ...records.rows import BACKWARD, CATEGORY_STAGE, CATEGORY_TEXT, LOSS, MSPROBE_GRAD_STAGE

STAGE_ORDER = {stage: i for i, stage in enumerate(STAGES)}
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
        module, slot = split_slot(self.name)
        if self.category == "actv_grad" and self.name == LOSS:
            return "gradient of the loss"
        if self.category == "actv" and slot:
            return f"forward {slot} of {module}"
        if self.category == "actv_grad" and slot:
            return f"backward {slot.replace('_grad', '')} gradient of {module}"
        if self.category == "loss" and self.name == "loss":
            return "loss"
        if self.category in CATEGORY_TEXT:
            return CATEGORY_TEXT[self.category].format(self.name)
        return f"{self.stage} {self.category} {self.name}"

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


def split_slot(name: str) -> tuple[str, str | None]:
    """("layers.1.fc2", "output") from "layers.1.fc2.output" (also .input_0, .output_grad)."""
    match = re.fullmatch(r"(?P<module>.+)\.(?P<slot>input|output)(?P<grad>_grad)?(?:_\d+)?", name)
    if not match:
        return name, None
    return match["module"], match["slot"] + (match["grad"] or "")

"""One compared value: a tensor's op at a (micro-)step, on a rank or as an order statistic over
ranks, with both sides' values and how far apart they are."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...records.rows import CATEGORY_TEXT
from ..analyse.events import split_slot
from .table import NO_MICRO


@dataclass
class Cell:
    step: int
    micro_step: int  # NO_MICRO: the whole step
    category: str
    vpp_stage: int
    name: str
    op: str
    statistic: str  # "rank" (rank by rank), "tensor" (one value per tensor), "min" | "median" | "max"
    rank: int | None  # the rank of b's value (rank by rank: the rank); None for an order statistic
    a_rank: int | None
    a: float
    b: float
    relative: float
    limit: float
    counted: bool = True

    def module(self) -> str | None:
        """The module an activation row belongs to (`fc2` of `fc2.output`), None otherwise."""
        if self.category in ("actv", "actv_grad"):
            module, slot = split_slot(self.name)
            return module if slot else None
        return None

    def what(self) -> str:
        """The tensor in words: "forward output of fc2", "reduced gradient of fc1.weight"."""
        module, slot = split_slot(self.name)
        if self.category == "actv" and slot:
            return f"forward {slot} of {module}"
        if self.category == "actv_grad" and slot:
            return f"backward {slot.replace('_grad', '')} gradient of {module}"
        if self.category == "loss":
            return "loss"
        if self.category in CATEGORY_TEXT:
            return CATEGORY_TEXT[self.category].format(self.name)
        return f"{self.category} {self.name}"

    def where(self) -> str:
        micro = f", micro-step {self.micro_step}" if self.micro_step != NO_MICRO else ""
        if self.statistic == "rank":
            who = f"rank {self.rank}"
        elif self.statistic == "tensor":
            who = f"rank {self.a_rank} of A against rank {self.rank} of B"
        else:
            who = f"the {self.statistic} over ranks"
        return f"step {self.step}{micro}, {who}"

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "micro_step": None if self.micro_step == NO_MICRO else self.micro_step,
            "category": self.category,
            "vpp_stage": self.vpp_stage,
            "name": self.name,
            "module": self.module(),
            "what": self.what(),
            "op": self.op,
            "statistic": self.statistic,
            "rank": self.rank,
            "a_rank": self.a_rank,
            "a": json_number(self.a),
            "b": json_number(self.b),
            "relative_difference": json_number(self.relative),
            "tolerance": json_number(self.limit),
            "counted": self.counted,
        }


def json_number(value: float) -> float | str:
    """A number JSON can hold; NaN and the infinities as the strings "nan", "inf", "-inf"."""
    return value if math.isfinite(value) else repr(value)

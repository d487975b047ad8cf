"""How each category is compared, from the two runs' layouts.

Whole-tensor categories (records/rows.py's REPLICATED_CATEGORIES: weights, reduced gradients,
moments, update/ratio) are exact statistics of the whole tensor under DDP, FSDP, ZeRO and
Megatron, so one value per tensor stands for the run whatever its layout. Rank-local ones
(rank-local gradients, activations and their gradients, the loss, L2 features, collectives)
are each rank's own.

- The same layout (the same ranks, and the same world size, parallel groups and micro-batches
  per step where the runs say so): every category rank by rank.
- Different layouts: a whole-tensor category as one value per tensor (every copy on one side
  against every copy on the other: any disagreement counts); a rank-local one through order
  statistics (min, median, max) over the ranks and micro-steps of a step, which a DDP run and a
  single-process run with the same global batch share. Where the micro-steps per step differ,
  the loss, activation gradients and rank-local gradients are compared but not counted in the
  verdict: a script divides its loss by its grad_acc_steps, so their scale follows it; so is
  grad_agreement, whose norm ratio follows the data-parallel degree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...records.rows import REPLICATED_CATEGORIES
from .source import RunFacts

RANK, TENSOR, ORDER = "rank", "tensor", "order"
MODE_TEXT = {
    RANK: "rank by rank",
    TENSOR: "one value per tensor",
    ORDER: "order statistics over ranks x micro-steps (min, median, max)",
}
WHOLE_TENSOR = frozenset(REPLICATED_CATEGORIES)
SCALED_BY_MICRO_STEPS = frozenset({"loss", "actv_grad", "grad_unreduced"})
FOLLOWS_DATA_PARALLEL = frozenset({"grad_agreement"})
LAYOUT_FACTS = ("world_size", "parallel", "grad_acc_steps")


@dataclass
class Layout:
    """Whether the runs share a layout, and so how each category is compared."""

    same: bool
    why: str
    micro_a: int | None = None
    micro_b: int | None = None

    def mode(self, category: str) -> str:
        if self.same:
            return RANK
        return TENSOR if category in WHOLE_TENSOR else ORDER

    def not_counted(self, category: str) -> str | None:
        """Why a category's differences do not count toward the verdict (None: they do)."""
        if self.same:
            return None
        if category in FOLLOWS_DATA_PARALLEL:
            return "its norm ratio follows the data-parallel degree"
        if category in SCALED_BY_MICRO_STEPS and self.micro_a != self.micro_b:
            return (
                f"its scale follows the micro-steps per step ({self.micro_a} against {self.micro_b}: "
                "a script divides its loss by them)"
            )
        return None

    def describe(self, category: str) -> str:
        reason = self.not_counted(category)
        return MODE_TEXT[self.mode(category)] + (f"; not counted: {reason}" if reason else "")


def decide(a: RunFacts, b: RunFacts) -> Layout:
    """The same layout when the ranks are the same and every layout fact both runs state agrees."""
    if a.ranks != b.ranks:
        return Layout(False, f"ranks {_ranks(a.ranks)} against {_ranks(b.ranks)}")
    job_a, job_b = _first(a.jobs), _first(b.jobs)
    for fact in LAYOUT_FACTS:
        x, y = _fact(job_a, fact), _fact(job_b, fact)
        if x is not None and y is not None and x != y:
            return Layout(False, f"{fact} {_text(x)} against {_text(y)}")
    return Layout(True, f"the same ranks ({_ranks(a.ranks)}) and layout")


def _first(jobs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return jobs[min(jobs)] if jobs else {}


def _fact(job: dict[str, Any], fact: str) -> Any:
    value = job.get(fact)
    if isinstance(value, dict):  # the groups' sizes; where they were found is no layout
        value = {k: v for k, v in value.items() if k != "from"}
    return value


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none"
    return str(value)


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))

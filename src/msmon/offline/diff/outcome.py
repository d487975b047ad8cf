"""A comparison's answer, assembled once and read by every output (terminal, JSON, DuckDB, HTML):
the verdict, the first divergence with its one-line interpretation, the front per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .cells import Cell, json_number
from .contract import Contract
from .findings import CategoryFront, Findings
from .layout import Layout
from .source import RunFacts
from .tolerance import Tolerance

PARTED, WITHIN = 1, 0


@dataclass
class Series:
    """One tensor's op over steps on both sides, for a chart."""

    cell: Cell
    steps: list[int]
    a: list[float | None]
    b: list[float | None]


@dataclass
class Outcome:
    a: RunFacts
    b: RunFacts
    contract: Contract
    layout: Layout
    tolerance: Tolerance
    findings: Findings
    categories: dict[str, str]  # category -> how it was compared
    interpretation: str | None
    top: list[Cell] = field(default_factory=list)
    series: list[Series] = field(default_factory=list)
    identical_files: int = 0
    parsed_chunks: int = 0

    @property
    def first(self) -> Cell | None:
        return self.findings.first

    def exit_code(self) -> int:
        return PARTED if self.first is not None else WITHIN

    def scope(self) -> str:
        f = self.findings
        return f"{len(f.steps)} steps x {len(f.tensors)} tensors ({f.values:,} values)"

    def verdict(self) -> str:
        first = self.first
        if first is not None:
            return (
                f"parted at step {first.step}: {first.what()} ({first.where()}): {first.op} {first.a:.7g} against "
                f"{first.b:.7g}, relative difference {first.relative:.3g} over {first.limit:.3g}"
            )
        f = self.findings
        only = sum(f.only_a.values()) + sum(f.only_b.values())
        missing = f"; {only:,} rows only on one side" if only else ""
        if f.identical:
            return f"identical over {self.scope()}{missing}"
        largest = max(self.findings.by_tensor.values(), key=lambda c: c.relative, default=None)
        detail = (
            f"; the largest relative difference {largest.relative:.3g}: {largest.what()} {largest.op} "
            f"at step {largest.step}"
            if largest is not None
            else ""
        )
        return f"within tolerance over {self.scope()}{detail}{missing}"

    def front(self) -> list[dict[str, Any]]:
        """Per step (those with rows over the tolerance, or all with `every`): the categories'
        rows compared and over, tensors over, and the largest relative difference."""
        rows = []
        for step in sorted(self.findings.front):
            categories = self.findings.front[step]
            over = sum(c.over for c in categories.values())
            largest = max(
                (c.largest for c in categories.values() if c.largest is not None),
                key=lambda c: c.relative,
                default=None,
            )
            rows.append(
                {
                    "step": step,
                    "compared": sum(c.compared for c in categories.values()),
                    "over": over,
                    "tensors_over": sum(len(c.over_tensors) for c in categories.values()),
                    "largest": largest.to_json() if largest is not None else None,
                    "categories": {name: _category(c) for name, c in sorted(categories.items())},
                }
            )
        return rows


def _category(front: CategoryFront) -> dict[str, Any]:
    largest = front.largest
    return {
        "compared": front.compared,
        "over": front.over,
        "tensors_over": len(front.over_tensors),
        "over_not_counted": front.over_not_counted,
        "largest_relative_difference": json_number(largest.relative) if largest else None,
        "tensor": largest.name if largest else None,
        "op": largest.op if largest else None,
        "rank": largest.rank if largest else None,
        "statistic": largest.statistic if largest else None,
    }

"""One run's statistics in memory, keyed for alignment: a row is one tensor's values at one
(step, micro-step) on one rank, as the CSV sink writes it.

    RowKey = (category, vpp_stage, name, step, micro_step)   micro_step -1: a row of the whole step

Only rows that must be compared value by value are held (`msmon diff` skips pairs of files that
are byte for byte the same, counting their rows in `Counted`), so a run of hundreds of ranks
that differs in a few values is never in memory whole.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

RowKey = tuple[str, int, str, int, int]
TensorKey = tuple[str, int, str]  # (category, vpp_stage, name)
NO_MICRO = -1  # a row of the whole step (no micro_step column, or the cell left empty)


@dataclass
class Row:
    """One tensor's statistics at one (micro-)step on one rank."""

    category: str
    vpp_stage: int
    name: str
    step: int
    micro_step: int
    rank: int
    ops: tuple[str, ...]
    values: tuple[float, ...]
    position: int = 0  # its place among the rows of its category and (micro-)step: execution order

    def key(self) -> RowKey:
        return (self.category, self.vpp_stage, self.name, self.step, self.micro_step)


@dataclass
class Counted:
    """Rows known without their values (files identical on both sides): what they cover."""

    rows: int = 0
    values: int = 0
    tensors: set[TensorKey] = field(default_factory=set)
    steps: set[int] = field(default_factory=set)
    per_step: Counter = field(default_factory=Counter)  # rows per (step, category)

    def merge(self, other: Counted) -> None:
        self.rows += other.rows
        self.values += other.values
        self.tensors |= other.tensors
        self.steps |= other.steps
        self.per_step.update(other.per_step)


@dataclass
class SideRows:
    """The rows of one side read for comparison: {RowKey: {rank: (ops, values)}}, with the
    tensors' positions (the smallest seen: training order within a step)."""

    rows: dict[RowKey, dict[int, tuple[tuple[str, ...], tuple[float, ...]]]] = field(default_factory=dict)
    positions: dict[TensorKey, int] = field(default_factory=dict)
    tensors: set[TensorKey] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)

    def add(self, row: Row) -> None:
        self.rows.setdefault(row.key(), {})[row.rank] = (row.ops, row.values)
        tensor = (row.category, row.vpp_stage, row.name)
        if tensor not in self.tensors:
            self.tensors.add(tensor)
            self.positions[tensor] = row.position
        elif row.position < self.positions[tensor]:
            self.positions[tensor] = row.position
        self.ranks.add(row.rank)

    def merge(self, other: SideRows) -> None:
        for key, by_rank in other.rows.items():
            self.rows.setdefault(key, {}).update(by_rank)
        for tensor, position in other.positions.items():
            self.positions[tensor] = min(position, self.positions.get(tensor, position))
        self.tensors |= other.tensors
        self.ranks |= other.ranks

    def micro_steps_per_step(self) -> int | None:
        """The most micro-steps a step has (rows with a micro_step), None when no row has one."""
        seen = [key[4] for key in self.rows if key[4] != NO_MICRO]
        return max(seen) + 1 if seen else None

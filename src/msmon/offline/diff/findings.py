"""What a comparison found, gathered as it goes: how much was compared, the first divergence in
training order, the front (per step and category: rows compared, rows and tensors over the
tolerance, the largest relative difference), each tensor's largest difference (the page's
charts), and, when asked for, every value that differs (the `diff` table)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .cells import Cell
from .order import order_key
from .table import Counted, TensorKey
from .tolerance import Tolerance, same


@dataclass
class CategoryFront:
    compared: int = 0  # rows: a tensor at a (micro-)step, on a rank or as an order statistic
    over: int = 0
    over_tensors: set[str] = field(default_factory=set)
    over_not_counted: int = 0  # rows over the tolerance in a category the verdict leaves out (layout.py)
    largest: Cell | None = None


@dataclass
class Findings:
    tolerance: Tolerance
    position: Callable[[TensorKey], int]  # a tensor's place in its step (order.py)
    pp_stage: Callable[[int | None], int]
    keep_differing: bool = False
    rows: int = 0
    values: int = 0
    identical: bool = True  # every value compared is the same bit for bit
    steps: set[int] = field(default_factory=set)
    tensors: set[TensorKey] = field(default_factory=set)
    only_a: Counter = field(default_factory=Counter)  # rows on one side only, per category
    only_b: Counter = field(default_factory=Counter)
    front: dict[int, dict[str, CategoryFront]] = field(default_factory=dict)
    by_tensor: dict[TensorKey, Cell] = field(default_factory=dict)
    first: Cell | None = None
    first_key: tuple | None = None
    differing: list[Cell] = field(default_factory=list)

    def add_counted(self, counted: Counted) -> None:
        """Rows of files identical on both sides: compared, and the same."""
        self.rows += counted.rows
        self.values += counted.values
        self.steps |= counted.steps
        self.tensors |= counted.tensors
        for (step, category), rows in counted.per_step.items():
            self._front(step, category).compared += rows

    def _front(self, step: int, category: str) -> CategoryFront:
        return self.front.setdefault(step, {}).setdefault(category, CategoryFront())

    def compare_row(
        self,
        make: Callable[[str, float, float, float, float], Cell],
        tensor: TensorKey,
        step: int,
        ops: Sequence[str],
        a: Sequence[float],
        b: Sequence[float],
        relative: Sequence[float],
        counted: bool,
    ) -> None:
        """One row of each side, its ops' relative differences given; `make(op, a, b, rel, limit)`
        builds the cell only where one is kept."""
        category = tensor[0]
        front = self._front(step, category)
        front.compared += 1
        self.rows += 1
        self.values += len(ops)
        self.steps.add(step)
        self.tensors.add(tensor)
        tol = self.tolerance
        worst: Cell | None = None
        worst_ratio = -1.0
        for op, x, y, rel in zip(ops, a, b, relative):
            if same(x, y):
                continue
            self.identical = False
            limit = tol.limit(category, op)
            over = tol.over(category, op, x, y, rel)
            cell: Cell | None = None
            if self.keep_differing:
                cell = make(op, x, y, rel, limit)
                self.differing.append(cell)
            if over:
                ratio = math.inf if limit == 0 else rel / limit
                if ratio > worst_ratio:
                    worst_ratio, worst = ratio, cell or make(op, x, y, rel, limit)
            if counted and (front.largest is None or rel > front.largest.relative):
                front.largest = cell = cell or make(op, x, y, rel, limit)
            known = self.by_tensor.get(tensor)
            if counted and (known is None or rel > known.relative):
                self.by_tensor[tensor] = cell or make(op, x, y, rel, limit)
        if worst is None:
            return
        if not counted:
            worst.counted = False
            front.over_not_counted += 1
            return
        front.over += 1
        front.over_tensors.add(tensor[2])
        key = order_key(worst, self.position(tensor), self.pp_stage(worst.rank))
        if self.first_key is None or key < self.first_key:
            self.first, self.first_key = worst, key

    def over_rows(self) -> int:
        return sum(f.over for fronts in self.front.values() for f in fronts.values())

    def top(self, count: int) -> list[Cell]:
        """The tensors that part most: the largest relative difference of each, largest first."""
        parting = [c for c in self.by_tensor.values() if c.relative > 0]
        return sorted(parting, key=lambda c: (-c.relative, c.step, c.category, c.name))[:count]

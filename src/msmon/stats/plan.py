"""Which reductions a list of ops needs, decided once per list from the op table (the engine's plan)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from . import ops as op_table
from .ops import BY_NAME, FIELDS, unknown


class _Plan:
    """Which reductions an ops list needs, decided once per list."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        for op in ops:
            if op not in BY_NAME:
                raise ValueError(unknown(op))
        self.ops = ops
        entries = [BY_NAME[op] for op in ops]
        self.op_fields = [entry.field for entry in entries]  # the field each op is read from
        fields = set(self.op_fields)
        self.norm = "norm" in fields
        self.minmax = "min" in fields or "max" in fields
        self.zeros = "zeros" in fields
        self.flags = "nans" in fields or "infs" in fields
        # the sum gives the mean, and is the NaN/Inf witness when min/max are not computed
        self.total = "sum" in fields or (self.flags and not self.minmax)
        # the ops with a reduction of their own (op.compute: the torch path computes them one by one)
        self.own: list[tuple[str, Callable[[Any, Any], Any]]] = [
            (entry.field, entry.compute) for entry in entries if entry.compute is not None
        ]
        self.per_element = [entry.per_element for entry in entries]
        self.scaled = any(self.per_element)
        self.divisor_key = tuple(self.per_element)
        self.fields = [
            name
            for name, wanted in (
                ("norm", self.norm),
                ("min", self.minmax),
                ("max", self.minmax),
                ("sum", self.total),
                ("zeros", self.zeros),
            )
            if wanted
        ]

        # the kernel's field indices, when it computes every op of the list (None: the torch path does)
        self.native_columns: list[int] | None = (
            [FIELDS.index(field) for field in self.op_fields] if all(entry.native for entry in entries) else None
        )
        self.unscaled = [False] * len(ops)

    @functools.cached_property
    def without_norm(self) -> _Plan:
        """The same reductions but the norm (computed for a whole batch in one call)."""
        return _Plan(tuple(op for op in self.ops if BY_NAME[op].field != "norm"))


@functools.lru_cache(maxsize=32)
def _plan(ops: tuple[str, ...]) -> _Plan:
    return _Plan(ops)


op_table.on_change(_plan.cache_clear)  # a plan is of the table as it was

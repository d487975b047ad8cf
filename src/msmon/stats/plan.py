"""Which reductions a list of ops needs, decided once per list from the op table (the engine's plan).

A list holding a derived op (msmon.stats.ops: `std`) is computed with the ops it is derived from
(`computed`: the list, then those it lacks); the derived op's column is a placeholder (its first
base's field) until `derive` fills it from theirs, and `returned` narrows the rows to the list."""

from __future__ import annotations

import functools
from typing import Any, Callable

from . import ops as op_table
from .inputs import RESULT_DTYPE as _FLOAT64
from .inputs import _accumulate_dtype
from .ops import BY_NAME, FIELDS, unknown, with_dependencies


class _Plan:
    """Which reductions an ops list needs, decided once per list."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        for op in ops:
            if op not in BY_NAME:
                raise ValueError(unknown(op))
        self.ops = ops
        self.computed = tuple(with_dependencies(ops))  # the columns computed: ops, then the bases they lack
        entries = [BY_NAME[op] for op in self.computed]
        # the field each column is read from (a derived op's: a placeholder, its first base's)
        self.op_fields = [BY_NAME[e.derived_from[0]].field if e.derive else e.field for e in entries]
        # (column, derive, {base: its column}) of each derived op, filled in from its bases' columns
        self.derived: list[tuple[int, Callable[..., Any], dict[str, int]]] = [
            (j, e.derive, {base: self.computed.index(base) for base in e.derived_from})
            for j, e in enumerate(entries)
            if e.derive is not None
        ]
        self.narrowed = len(self.computed) > len(ops)  # the rows hold bases the list lacks
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
        self.unscaled = [False] * len(self.computed)

    def accumulate(self, dtype: Any) -> Any:
        """The dtype the torch paths sum in: the input's accumulation dtype (float32 for 16- and
        32-bit floats), float64 where a derived op is derived from the sums (std from the sum
        of squares and the sum: in float32 a near-constant tensor's spread would be lost)."""
        return _FLOAT64 if self.derived else _accumulate_dtype(dtype)

    def finish(self, rows: Any, counts: Any) -> Any:
        """Scaled [n, computed] rows to the [n, ops] result: each derived op's column filled from
        its bases' and the [n] element counts (float64, rows' device), the bases the list lacks
        left out. The rows themselves when the list holds no derived op."""
        for column, derive, bases in self.derived:
            rows[:, column] = derive({base: rows[:, j] for base, j in bases.items()}, counts)
        return rows[:, : len(self.ops)] if self.narrowed else rows

    @functools.cached_property
    def without_norm(self) -> _Plan:
        """The same reductions but the norm (computed for a whole batch in one call)."""
        fields = zip(self.computed, self.op_fields)
        return _Plan(tuple(op for op, field in fields if field != "norm" and not BY_NAME[op].derive))


@functools.lru_cache(maxsize=32)
def _plan(ops: tuple[str, ...]) -> _Plan:
    return _Plan(ops)


op_table.on_change(_plan.cache_clear)  # a plan is of the table as it was

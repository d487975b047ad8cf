"""Which reductions a list of ops needs, decided once per list (the engine's plan)."""

from __future__ import annotations

import functools

from .ops import BY_NAME, FIELDS, unknown


class _Plan:
    """Which reductions an ops list needs, decided once per list."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        for op in ops:
            if op not in BY_NAME:
                raise ValueError(unknown(op))
        self.ops = ops
        self.op_fields = [BY_NAME[op].field for op in ops]  # the field each op is read from
        self.norm = "norm" in ops
        self.minmax = "min" in ops or "max" in ops
        self.zeros = "zeros" in ops
        self.flags = "nans" in ops or "infs" in ops
        # the sum gives the mean, and is the NaN/Inf witness when min/max are not computed
        self.total = "mean" in ops or (self.flags and not self.minmax)
        self.per_element = [BY_NAME[op].per_element for op in ops]
        self.scaled = any(self.per_element)
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

        self.native_columns = [FIELDS.index(field) for field in self.op_fields]  # the kernel's field indices
        self.unscaled = [False] * len(ops)

    @functools.cached_property
    def without_norm(self) -> _Plan:
        """The same reductions but the norm (computed for a whole batch in one call)."""
        return _Plan(tuple(op for op in self.ops if op != "norm"))


@functools.lru_cache(maxsize=32)
def _plan(ops: tuple[str, ...]) -> _Plan:
    return _Plan(ops)

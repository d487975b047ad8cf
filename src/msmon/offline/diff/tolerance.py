"""How far apart two stored statistics may be: the relative difference of each op, and the
three modes that judge it.

The relative difference of two values: 0 when they are the same (both NaN counts as the same),
infinite when one is non-finite and the other is not the same; else |a - b| over a scale:
- `norm` and any column of its own (the loss, cos, L2 features): max(|a|, |b|);
- `min`, `max`, `mean`: the tensor's magnitude, max(|a|, |b|, |min|, |max| of both rows), since a
  mean near zero moves by more than itself when its tensor barely changes;
- `zeros` (a fraction): |a - b| itself; `nans`, `infs` (counts): 0 when equal, else infinite.

Modes: `exact` (the stored values bit for bit), `relative` (a limit of max(--rtol, floor)), and
`calibrated` (per category and op, the largest difference seen among reruns of the job times a
factor, from a golden file; never below the floor). The floor is what the runs can resolve: one
rounding of the lowest-precision dtype of their parameters, and of how the values were stored
(CSV's `ndigits` significant digits, which the Parquet files hold too: 10^(1-ndigits);
TensorBoard's float32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

DTYPE_EPS = {"float64": 2.220446e-16, "float32": 1.192093e-07, "float16": 9.765625e-04, "bfloat16": 7.8125e-03}
PRECISION = ["float64", "float32", "float16", "bfloat16"]  # from the finest to the coarsest
FLOAT32_STORED = 2.4e-07  # two float32 roundings (TensorBoard scalars)
LOCATION_OPS = frozenset({"min", "max", "mean"})
FRACTION_OPS = frozenset({"zeros"})
COUNT_OPS = frozenset({"nans", "infs"})
DEFAULT_NDIGITS = 6


def same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


def differences(ops: Sequence[str], a: Sequence[float], b: Sequence[float]) -> list[float]:
    """The relative difference of each op of two rows of the same tensor."""
    scale = 0.0
    for op, x, y in zip(ops, a, b):
        if op in ("min", "max") and math.isfinite(x) and math.isfinite(y):
            scale = max(scale, abs(x), abs(y))
    out = []
    for op, x, y in zip(ops, a, b):
        if same(x, y):
            out.append(0.0)
        elif not (math.isfinite(x) and math.isfinite(y)) or op in COUNT_OPS:
            out.append(math.inf)
        elif op in FRACTION_OPS:
            out.append(abs(x - y))
        else:
            size = max(abs(x), abs(y), scale if op in LOCATION_OPS else 0.0)
            out.append(abs(x - y) / size)
    return out


def dtype_of(param_dtypes: Sequence[str]) -> str:
    """The coarsest floating dtype among the parameters' (float32 when none is known)."""
    known = [d for d in param_dtypes if d in DTYPE_EPS]
    return max(known, key=PRECISION.index) if known else "float32"


def storage_floor(storage: Sequence[str], ndigits: int) -> float:
    """What storing the values costs them: CSV's digits (Parquet holds the CSV's rounding, so
    the same), TensorBoard's float32."""
    floor = 0.0
    if "csv" in storage or "parquet" in storage:
        floor = max(floor, 10.0 ** (1 - ndigits))
    if "tensorboard" in storage:
        floor = max(floor, FLOAT32_STORED)
    return floor


class Tolerance:
    """A mode: whether a difference is over the limit, and the words that say which mode it is."""

    mode = ""

    def __init__(self, floor: float, dtype: str, default: bool = False) -> None:
        self.floor = floor
        self.dtype = dtype
        self.default = default

    def limit(self, category: str, op: str) -> float:
        raise NotImplementedError

    def over(self, category: str, op: str, a: float, b: float, relative: float) -> bool:
        return relative > self.limit(category, op)

    def describe(self) -> str:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "default": self.default, "floor": self.floor, "dtype": self.dtype}


class Exact(Tolerance):
    """Bit equality of the stored values (the CI mode for deterministic jobs)."""

    mode = "exact"

    def limit(self, category: str, op: str) -> float:
        return 0.0

    def over(self, category: str, op: str, a: float, b: float, relative: float) -> bool:
        return not same(a, b)

    def describe(self) -> str:
        return "exact (the stored values bit for bit)"


class Relative(Tolerance):
    """|a - b| / scale at most max(rtol, floor)."""

    mode = "relative"

    def __init__(self, rtol: float, floor: float, dtype: str, default: bool = False) -> None:
        super().__init__(floor, dtype, default)
        self.rtol = rtol

    def limit(self, category: str, op: str) -> float:
        return max(self.rtol, self.floor)

    def describe(self) -> str:
        bound = max(self.rtol, self.floor)
        if self.default:
            return (
                f"relative {bound:.2g}, the floor of the runs' {self.dtype} and stored digits (the default; "
                "--exact for bit equality, --rtol R, or a golden file from --calibrate)"
            )
        floored = f" (raised from --rtol {self.rtol:g} to the floor of {self.dtype} and stored digits)"
        return f"relative {bound:.2g}" + (floored if self.rtol < self.floor else "")

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "rtol": self.rtol, "limit": max(self.rtol, self.floor)}


class Calibrated(Tolerance):
    """Per category and op, the largest difference among reruns times `factor` (a golden file)."""

    mode = "calibrated"

    def __init__(self, limits: dict[str, dict[str, float]], floor: float, dtype: str, source: str) -> None:
        super().__init__(floor, dtype)
        self.limits = limits
        self.source = source

    def limit(self, category: str, op: str) -> float:
        return max(self.limits.get(category, {}).get(op, 0.0), self.floor)

    def describe(self) -> str:
        largest = max((v for ops in self.limits.values() for v in ops.values()), default=0.0)
        return (
            f"calibrated from {self.source} (per category and op, up to {max(largest, self.floor):.2g}; "
            f"floor {self.floor:.2g})"
        )

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "source": self.source, "limits": self.limits}

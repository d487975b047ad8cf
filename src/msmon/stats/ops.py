"""The statistics msmon records per tensor ("ops"), each declared once, as one entry of TABLE.

An entry says everything msmon needs of a statistic: its name in the config and the output (its
CSV column and TensorBoard tag suffix), how a tensor gives it (a reduction the engine computes
with the others, or a compute function of its own), whether that value is divided by the element
count, how the statistics of disjoint pieces of one tensor (ZeRO partitions, the calls of one
communication op) give the whole tensor's, and whether the native kernel computes it. The config
validates against this table, msmon.stats plans, computes (msmon.stats.plan, msmon.stats.scalar,
the kernel's columns in msmon.stats.native) and combines by it, msmon.anomaly.rules and
msmon.offline.results read it. A new statistic is one `register(Op(...))` call (docs/architecture.md).
Nothing here imports torch: the config and the results database must not.

The combine rules act on torch tensors through their methods only (no torch import):
`col` holds the pieces' values along dim 0, `counts` their element counts (as col's dtype),
`keep` where a piece is not empty (empty pieces are left out), `total` the summed counts, and
`r` reduces over the pieces (`r.sum`, `r.min`, `r.max`; msmon.stats.combine.combine_rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

# The reductions ("fields") the engine computes together for all ops read from them, in one pass
# where it can; in the native kernel's order (fused_stats.cpp), which computes exactly these
FIELDS = ("norm", "min", "max", "sum", "zeros", "nans", "infs")
KINDS = ("magnitude", "average", "fraction", "count")


def root_sum_squares(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.sum(col.where(keep, 0.0).square()).sqrt()


def min_of_mins(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.min(col.where(keep, math.inf))


def max_of_maxes(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.max(col.where(keep, -math.inf))


def count_weighted_mean(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.sum((col * counts).where(keep, 0.0)) / total


def count_weighted_fraction(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    # the zero counts recovered from each fraction, so the combined fraction is exactly the direct one
    return r.sum((col * counts).round().where(keep, 0.0)) / total


def summed(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.sum(col.where(keep, 0.0))


@dataclass(frozen=True)
class Op:
    """One statistic of a tensor."""

    name: str  # in the config's `ops` and in msprobe's
    column: str  # its CSV column (and the last part of its TensorBoard tag)
    field: str  # the reduction it is read from: one of FIELDS, or its own name when it has `compute`
    per_element: bool  # the value divided by the element count (a mean, a fraction)
    kind: str  # "magnitude" (of the tensor's values), "average", "fraction" or "count" (KINDS)
    combine: Callable[..., Any]  # the whole tensor's value from its pieces' (see above)
    # its own reduction, for an op no field gives: `compute(x, acc)` of a floating-point tensor x
    # and the dtype to accumulate in, a 0-d tensor (a sum or a count when per_element), on x's
    # device and without host sync; computed by torch reductions, never by the native kernel
    compute: Callable[[Any, Any], Any] | None = None

    @property
    def native(self) -> bool:
        """Whether the native kernel computes it (it computes the FIELDS, nothing else)."""
        return self.compute is None


TABLE: list[Op] = [
    Op("norm", "norm", "norm", False, "magnitude", root_sum_squares),
    Op("min", "min", "min", False, "magnitude", min_of_mins),
    Op("max", "max", "max", False, "magnitude", max_of_maxes),
    Op("mean", "mean", "sum", True, "average", count_weighted_mean),
    Op("zeros", "zeros", "zeros", True, "fraction", count_weighted_fraction),
    Op("nans", "nans", "nans", False, "count", summed),
    Op("infs", "infs", "infs", False, "count", summed),
]

# Views of TABLE, kept in step with it in place (modules hold them by reference: `from .ops import OPS`)
OPS: list[str] = []
BY_NAME: dict[str, Op] = {}
MAGNITUDE_OPS: list[str] = []
COUNT_OPS: list[str] = []
PER_ELEMENT_OPS: list[str] = []
_listeners: list[Callable[[], None]] = []


def _derive() -> None:
    OPS[:] = [op.name for op in TABLE]
    BY_NAME.clear()
    BY_NAME.update((op.name, op) for op in TABLE)
    MAGNITUDE_OPS[:] = [op.name for op in TABLE if op.kind == "magnitude"]
    COUNT_OPS[:] = [op.name for op in TABLE if op.kind == "count"]
    PER_ELEMENT_OPS[:] = [op.name for op in TABLE if op.per_element]
    for listener in _listeners:
        listener()


_derive()


def _check(op: Op) -> None:
    if op.name in BY_NAME:
        raise ValueError(f"op {op.name!r} is already in the table")
    if op.kind not in KINDS:
        raise ValueError(f"op {op.name!r}: kind {op.kind!r} is not one of {list(KINDS)}")
    if op.compute is None and op.field not in FIELDS:
        raise ValueError(f"op {op.name!r}: field {op.field!r} is not one of {list(FIELDS)} and no compute is given")
    if op.compute is not None and (op.field != op.name or op.name in FIELDS):
        raise ValueError(f"op {op.name!r}: an op with its own compute is its own field, named unlike {list(FIELDS)}")
    if not callable(op.combine) or not op.name.isidentifier() or not op.column.isidentifier():
        raise ValueError(f"op {op.name!r}: a callable combine rule and identifier-like name and column")


def register(op: Op) -> None:
    """Add a statistic to the table: the config accepts it in `ops`, the engine computes it, pieces
    combine by its rule and every sink writes it from then on, in this process."""
    _check(op)
    TABLE.append(op)
    _derive()


def unregister(name: str) -> None:
    """Take a registered statistic out of the table again (a test's fixture)."""
    if name not in BY_NAME:
        raise ValueError(unknown(name))
    TABLE[:] = [op for op in TABLE if op.name != name]
    _derive()


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener` whenever the table changes (what msmon.stats caches per ops list forgets it)."""
    _listeners.append(listener)


def unknown(op: str) -> str:
    """The message for an op name that is not in the table."""
    return f"unknown op {op!r}; valid ops are {list(OPS)}"

"""The statistics msmon records per tensor ("ops"), declared once.

Each op says what it is named in the config and the output (its CSV column and TensorBoard tag
suffix), which reduction of the tensor it is read from, whether that reduction is divided by
the element count, and how the statistics of disjoint pieces of one tensor (ZeRO partitions,
the calls of one communication op) give the whole tensor's. msmon.config validates against
this table, msmon.stats computes and combines by it, msmon.anomaly.rules and msmon.results read
it. Nothing here imports torch: the config and the results database must not.

The combine rules act on torch tensors through their methods only (no torch import):
`col` holds the pieces' values along dim 0, `counts` their element counts (as col's dtype),
`keep` where a piece is not empty (empty pieces are left out), `total` the summed counts, and
`r` reduces over the pieces (`r.sum`, `r.min`, `r.max`; msmon.stats.combine_rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

# The reductions ("fields") an op is read from, in the native kernel's order (fused_stats.cpp)
FIELDS = ("norm", "min", "max", "sum", "zeros", "nans", "infs")


def _root_sum_squares(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.sum(col.where(keep, 0.0).square()).sqrt()


def _min_of_mins(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.min(col.where(keep, math.inf))


def _max_of_maxes(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.max(col.where(keep, -math.inf))


def _count_weighted_mean(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.sum((col * counts).where(keep, 0.0)) / total


def _count_weighted_fraction(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    # the zero counts recovered from each fraction, so the combined fraction is exactly the direct one
    return r.sum((col * counts).round().where(keep, 0.0)) / total


def _summed(r: Any, col: Any, counts: Any, keep: Any, total: Any) -> Any:
    return r.sum(col.where(keep, 0.0))


@dataclass(frozen=True)
class Op:
    """One statistic of a tensor."""

    name: str  # in the config's `ops` and in msprobe's
    column: str  # its CSV column (and the last part of its TensorBoard tag)
    field: str  # the reduction it is read from (one of FIELDS)
    per_element: bool  # the field divided by the element count (a mean, a fraction)
    kind: str  # "magnitude" (of the tensor's values), "average", "fraction" or "count"
    combine: Callable[..., Any]  # the whole tensor's value from its pieces' (see above)


TABLE: tuple[Op, ...] = (
    Op("norm", "norm", "norm", False, "magnitude", _root_sum_squares),
    Op("min", "min", "min", False, "magnitude", _min_of_mins),
    Op("max", "max", "max", False, "magnitude", _max_of_maxes),
    Op("mean", "mean", "sum", True, "average", _count_weighted_mean),
    Op("zeros", "zeros", "zeros", True, "fraction", _count_weighted_fraction),
    Op("nans", "nans", "nans", False, "count", _summed),
    Op("infs", "infs", "infs", False, "count", _summed),
)

OPS: tuple[str, ...] = tuple(op.name for op in TABLE)
BY_NAME: dict[str, Op] = {op.name: op for op in TABLE}
MAGNITUDE_OPS: tuple[str, ...] = tuple(op.name for op in TABLE if op.kind == "magnitude")
COUNT_OPS: tuple[str, ...] = tuple(op.name for op in TABLE if op.kind == "count")
PER_ELEMENT_OPS: tuple[str, ...] = tuple(op.name for op in TABLE if op.per_element)


def unknown(op: str) -> str:
    """The message for an op name that is not in the table."""
    return f"unknown op {op!r}; valid ops are {list(OPS)}"

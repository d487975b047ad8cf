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

An op may instead be derived from other ops (`derived_from`), such as `std` from the norm (the
square root of the sum of squares), the mean (the sum over the count) and the count: a row then
carries the ops it is derived from (`with_dependencies`: appended after the ops asked for, and
left out of what is written), pieces combine those by their own rules, exactly, and the derived
value is computed again from the combined ones. So it is as exact across pieces and ranks as
they are, and computed wherever they are: by the native kernel, the torch reductions and the
accelerator path alike (each summing a row's bases in float64 where it holds a derived op).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
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


def sample_std(columns: Mapping[str, Any], counts: Any) -> Any:
    """The sample standard deviation, as torch.std gives it (Bessel's correction: divided by
    n - 1): sqrt((sum of squares - n * mean^2) / (n - 1)), from the norm's and the mean's columns
    and the element counts. One element has a spread of 0 (torch leaves it undefined, NaN: in a
    monitor's row a NaN says the tensor held one, and the alerts, the non-finite origin and
    `alert.on_nan: "stop"` would take a one-element tensor for a broken one). A row holding it
    has its bases summed in float64 on every path (msmon.stats.plan: `accumulate`), so the
    cancellation costs about 1e-16 times (mean / std)^2 of it: a constant tensor's std is 0 or
    within 1e-8 of its mean's size."""
    squares = columns["norm"].square() - counts * columns["mean"].square()
    return (squares.clamp(min=0.0) / (counts - 1.0).clamp(min=1.0)).sqrt()


@dataclass(frozen=True)
class Op:
    """One statistic of a tensor."""

    name: str  # in the config's `ops` and in msprobe's
    column: str  # its CSV column (and the last part of its TensorBoard tag)
    field: str  # the reduction it is read from: one of FIELDS, or its own name when it has `compute`
    per_element: bool  # the value divided by the element count (a mean, a fraction)
    kind: str  # "magnitude" (of the tensor's values), "average", "fraction" or "count" (KINDS)
    # the whole tensor's value from its pieces' (see above); None for a derived op
    combine: Callable[..., Any] | None
    # its own reduction, for an op no field gives: `compute(x, acc)` of a floating-point tensor x
    # and the dtype to accumulate in, a 0-d tensor (a sum or a count when per_element), on x's
    # device and without host sync; computed by torch reductions, never by the native kernel
    compute: Callable[[Any, Any], Any] | None = None
    # the ops it is derived from (none of them derived), and `derive(columns, counts)`: its
    # column from theirs ({op: column}) and the element counts (see above)
    derived_from: tuple[str, ...] = ()
    derive: Callable[[Mapping[str, Any], Any], Any] | None = None

    @property
    def native(self) -> bool:
        """Whether the native kernel computes it (it computes the FIELDS, nothing else; a derived
        op is computed from ops it computes)."""
        return self.compute is None


TABLE: list[Op] = [
    Op("norm", "norm", "norm", False, "magnitude", root_sum_squares),
    Op("min", "min", "min", False, "magnitude", min_of_mins),
    Op("max", "max", "max", False, "magnitude", max_of_maxes),
    Op("mean", "mean", "sum", True, "average", count_weighted_mean),
    Op("zeros", "zeros", "zeros", True, "fraction", count_weighted_fraction),
    Op("nans", "nans", "nans", False, "count", summed),
    Op("infs", "infs", "infs", False, "count", summed),
    Op("std", "std", "std", False, "magnitude", None, derived_from=("norm", "mean"), derive=sample_std),
]

# Views of TABLE, kept in step with it in place (modules hold them by reference: `from .ops import OPS`)
OPS: list[str] = []
BY_NAME: dict[str, Op] = {}
MAGNITUDE_OPS: list[str] = []
COUNT_OPS: list[str] = []
PER_ELEMENT_OPS: list[str] = []


def _derive() -> None:
    OPS[:] = [op.name for op in TABLE]
    BY_NAME.clear()
    BY_NAME.update((op.name, op) for op in TABLE)
    MAGNITUDE_OPS[:] = [op.name for op in TABLE if op.kind == "magnitude"]
    COUNT_OPS[:] = [op.name for op in TABLE if op.kind == "count"]
    PER_ELEMENT_OPS[:] = [op.name for op in TABLE if op.per_element]
    for listener in (*_caches, *_listeners):
        listener()


_caches: list[Callable[[], None]] = []
_listeners: list[Callable[[], None]] = []
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
    if not op.name.isidentifier() or not op.column.isidentifier():
        raise ValueError(f"op {op.name!r}: an identifier-like name and column")
    if op.derive is None and (op.derived_from or not callable(op.combine)):
        raise ValueError(f"op {op.name!r}: a callable combine rule, or `derive` with the ops it is derived from")
    if op.derive is not None:
        bases = [BY_NAME.get(name) for name in op.derived_from]
        if not op.derived_from or any(base is None or base.derive is not None for base in bases):
            raise ValueError(f"op {op.name!r}: derived from ops of the table that are not derived: {op.derived_from}")
        if op.combine is not None or op.compute is not None or op.per_element or op.field != op.name:
            raise ValueError(f"op {op.name!r}: a derived op is its own field, with no combine, compute or per_element")


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


@functools.lru_cache(maxsize=64)
def _with_dependencies(ops: tuple[str, ...]) -> tuple[str, ...]:
    added = [base for op in ops if op in BY_NAME for base in BY_NAME[op].derived_from if base not in ops]
    return ops + tuple(dict.fromkeys(added))


def with_dependencies(ops: Sequence[str]) -> list[str]:
    """`ops` followed by the ops its derived ones are derived from that it lacks: the columns of
    a row, what pieces combine by."""
    return list(_with_dependencies(tuple(ops)))


_caches.append(_with_dependencies.cache_clear)


def on_change(listener: Callable[[], None]) -> None:
    """Call `listener` whenever the table changes (what msmon.stats caches per ops list forgets it)."""
    _listeners.append(listener)


def unknown(op: str) -> str:
    """The message for an op name that is not in the table."""
    return f"unknown op {op!r}; valid ops are {list(OPS)}"

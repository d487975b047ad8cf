"""Which statistics of a row prove that its tensor was finite.

min and max propagate NaN and are +-inf when an inf is present (torch.aminmax and the native
kernel alike), so a finite min and max prove the tensor finite; so do NaN and inf counts of
zero. A norm, a mean or a sum cannot: they overflow to inf on large finite values (a gradient
scaled by a GradScaler), and a row that holds such an inf beside a finite min and max describes
a finite tensor. The non-finite origin, `alert.on_nan: "stop"` and AnomalyNan all ask here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def finiteness_columns(ops: Sequence[str]) -> tuple[list[int], list[int]] | None:
    """(columns that must be finite, columns that must be zero) for a row of `ops` to describe a
    finite tensor; None when the ops cannot tell."""
    ops = list(ops)
    if "min" in ops and "max" in ops:
        return [ops.index("min"), ops.index("max")], []
    if "nans" in ops and "infs" in ops:
        return [], [ops.index("nans"), ops.index("infs")]
    return None


def row_is_finite(ops: Sequence[str], row: Sequence[float]) -> bool | None:
    """Whether the tensor a host row of `ops` describes was finite; None when the ops cannot tell."""
    columns = finiteness_columns(ops)
    if columns is None:
        return None
    finite, zero = columns
    return all(math.isfinite(row[i]) for i in finite) and all(row[i] == 0 for i in zero)

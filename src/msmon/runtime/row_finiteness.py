"""Whether a tensor was free of NaN/Inf, told by the statistics row already taken of it.

The non-finite origin needs one flag per module input and output and per gradient of them.
Where the activation collector has read that very tensor in the same step (all_xy), reading it
once more for the flag would double the cost of both; the row answers instead (the columns
that can: stats/finiteness.py). The test runs once per step on all such rows together
(StepBuffer.take), never in a hook.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..stats.finiteness import finiteness_columns


class RowFiniteness:
    """Which columns of a row of `ops` tell finiteness, and how."""

    __slots__ = ("ops", "finite_columns", "zero_columns")

    def __init__(self, ops: tuple[str, ...], finite_columns: list[int], zero_columns: list[int]) -> None:
        self.ops = ops
        self.finite_columns = finite_columns  # must be finite (min, max)
        self.zero_columns = zero_columns  # must be zero (nans, infs)

    @classmethod
    def for_ops(cls, ops: Sequence[str]) -> RowFiniteness | None:
        """None when the ops cannot tell (a norm or a sum can overflow to inf on finite data:
        stats/finiteness.py)."""
        columns = finiteness_columns(ops)
        return None if columns is None else cls(tuple(ops), *columns)

    def flags(self, rows: torch.Tensor) -> torch.Tensor:
        """[n] bool: is each row's tensor finite (rows: [n, len(ops)])."""
        if self.finite_columns:
            return torch.isfinite(rows[:, self.finite_columns]).all(dim=1)
        return (rows[:, self.zero_columns] == 0).all(dim=1)


_LAST: list[tuple[tuple[str, ...], RowFiniteness | None]] = [((), None)]


def row_finiteness(ops: Sequence[str]) -> RowFiniteness | None:
    """RowFiniteness.for_ops, kept for the ops of the last call (they change only on a reload)."""
    key = tuple(ops)
    last = _LAST[0]
    if last[0] == key:
        return last[1]
    made = RowFiniteness.for_ops(key)
    _LAST[0] = (key, made)
    return made

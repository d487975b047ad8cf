"""`alert.on_nan: "stop"`'s question to a rank at the end of a step: did its statistics show a
tensor holding a NaN or an inf? Read from the step's one host copy (on a GPU: once the step's
kernels finished), so the answer is this step's, and every rank stops after the same step
(step_actions.py's vote).

Only tensors count: a derived value that is undefined (the gradient agreement's cos of a rank
whose local gradient is exactly zero, 0/0: records.DERIVED_CATEGORIES) and a norm that
overflowed on a tensor whose min and max prove it finite (stats/finiteness.py) never stop a job
that trains on finite data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ...records.rows import DERIVED_CATEGORIES, RowKey
from ...stats.finiteness import row_is_finite

if TYPE_CHECKING:
    from ..transfer import HostBatch


def has_nonfinite(batch: HostBatch | None, ops: Sequence[str]) -> bool:
    """Whether a step's rows (of `ops`) or its finiteness flags show a tensor holding a NaN or an
    inf; waits for the step's copy to reach the host."""
    if batch is None:
        return False
    batch.wait()
    values = batch.values  # a host tensor
    if values.numel():
        suspect = (~torch.isfinite(values).all(1)).nonzero().view(-1).tolist()
        if suspect and any(_tensor_nonfinite(batch.keys[i], ops, values[i]) for i in suspect):
            return True
    return not all(batch.finite_flags())


def _tensor_nonfinite(key: RowKey, ops: Sequence[str], row: torch.Tensor) -> bool:
    """Whether a row holding a non-finite value shows a non-finite tensor."""
    if key.category in DERIVED_CATEGORIES:
        return False
    if key.op is not None:  # one value of its own column: the loss itself
        return True
    finite = row_is_finite(ops, row.tolist())
    return finite is not True  # ops that cannot tell (a norm alone): a non-finite value counts

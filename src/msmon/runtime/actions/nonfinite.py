"""`alert.on_nan: "stop"`'s question to a rank at the end of a step: did its statistics hold a NaN
or an inf? Read from the step's one host copy (on a GPU: once the step's kernels finished), so the
answer is this step's, and every rank stops after the same step (step_actions.py's vote)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..transfer import HostBatch


def has_nonfinite(batch: HostBatch | None) -> bool:
    """Whether a step's statistics (or its finiteness flags) hold a NaN or an inf; waits for the
    step's copy to reach the host."""
    if batch is None:
        return False
    batch.wait()
    if batch.values.numel() and not bool(torch.isfinite(batch.values).all()):  # a host tensor
        return True
    return not all(batch.finite_flags())

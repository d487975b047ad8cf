"""Gradient agreement (`grad_agreement`): how far a rank's own gradient points where the
data-parallel average does.

Per rank and step, over every monitored parameter that DDP reduces:
    cos        = <local, reduced> / (|local| |reduced|)
    norm_ratio = |local| / |reduced|
`local` is the rank-local gradient of the step (grad_unreduced's tensor), `reduced` the
all-reduced average DDP leaves in `.grad` (grad_reduced's). Ranks fed similar data have cos
near 1 and a ratio near 1 (more when their batches are noisy: the average cancels noise); a
rank whose data departs has its cos drop. No collective is added: both tensors are on this rank.

What it costs: DDP overwrites `.grad` with the reduction (in place, or by copying its bucket
back at the end of backward), so the local gradient must be copied before DDP sees it: one copy
of the monitored gradients, taken in grads.py's post-accumulate hook of the backward pass DDP
reduces (the copy grads.py keeps anyway when DDP reduces an earlier micro-batch), and released
at the end of that backward pass. That is the memory of one gradient for the length of a
backward pass, on recorded steps only, which is why the key is off by default. The sums
(a dot product and two norms per parameter) run on the device at the end of that backward
pass, once DDP's own end-of-backward work has run (an autograd callback queued from within the
first callback runs after every callback queued during backward, DDP's included); both tensors
are then in the same scale (a GradScaler's, or none) and nothing has clipped them yet.

Not available, said once in the log (docs/loss.md): a single process (the local gradient is
the reduced one); frameworks that reduce in their own buffers or keep a shard of the reduced
gradient (DeepSpeed, Megatron, FSDP: `hooks_unreduced` adapters), where msmon has no whole
reduced gradient beside the local one in this version; and data parallelism without a DDP
module (a manual all-reduce), where nothing tells when the reduction happens.
"""

from __future__ import annotations

import logging

import torch

from ..output.records import RowKey

logger = logging.getLogger("msmon")

CATEGORY, NAME = "grad_agreement", "model"


def unavailable(data_parallel: bool, hooks_unreduced: bool, adapter_name: str) -> str | None:
    """Why the agreement cannot be recorded here, None when it can."""
    if not data_parallel:
        return "a single process: its local gradient is the reduced one"
    if hooks_unreduced:
        return (
            f"{adapter_name} reduces gradients in its own buffers or keeps only a shard of the reduced "
            "gradient (DeepSpeed, Megatron, FSDP); msmon records the agreement under torch DDP only"
        )
    return None


def agreement(local: list[torch.Tensor], reduced: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, norm_ratio) of the concatenations of `local` and `reduced` (pairs of one shape),
    as 0-d float64 tensors on the device; a zero gradient gives NaN."""
    dots = torch.stack([torch.dot(a.reshape(-1).float(), b.reshape(-1).float()) for a, b in zip(local, reduced)])
    local_sq = torch.stack(torch._foreach_norm(local)).double().square().sum()
    reduced_sq = torch.stack(torch._foreach_norm(reduced)).double().square().sum()
    dot = dots.double().sum()
    local_norm, reduced_norm = local_sq.sqrt(), reduced_sq.sqrt()
    return dot / (local_norm * reduced_norm), local_norm / reduced_norm


def of_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The agreement of (local, reduced) pairs, leaving out a missing, sparse or reshaped
    reduced gradient; None when no pair is left."""
    kept = [(a, b) for a, b in pairs if b is not None and b.layout == torch.strided and a.shape == b.shape]
    if not kept:
        return None
    return agreement([a for a, _ in kept], [b for _, b in kept])


def add_rows(buffer, ops: list[str], cos: torch.Tensor, ratio: torch.Tensor) -> None:
    """The step's agreement rows: one value each, as wide as the step's ops (records.COLUMN_CATEGORIES)."""
    width = len(ops)
    buffer.add(RowKey(CATEGORY, NAME, 0, None, op="cos"), cos.reshape(1).expand(width))
    buffer.add(RowKey(CATEGORY, NAME, 0, None, op="norm_ratio"), ratio.reshape(1).expand(width))


def say_unavailable(rank: int, why: str) -> None:
    logger.warning("msmon[rank %d]: grad_agreement is not recorded: %s (said once)", rank, why)

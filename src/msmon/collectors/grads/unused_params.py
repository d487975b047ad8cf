"""Parameters DDP reduced that this rank did not use (`find_unused_parameters=True`: a branch
taken on some ranks only), for the gradient agreement.

The local copy of a gradient is taken in its post-accumulate hook, which never runs for a
parameter the backward pass did not reach. DDP all-reduces zeros for it all the same and writes
the average into its `.grad`, so the reduced gradient (the average of the ranks that used it)
counts in |reduced| and in no local copy: leaving it out of the sums made cos and the norm
ratio those of the other parameters only. Such a parameter's rank-local gradient is exactly
zero, when no earlier micro-batch of the step reached it: it gets a local sum of zero
(local_sums.py; a later micro-batch that reaches it adds its gradient), which enters the sums
beside its reduced gradient. When an earlier micro-batch (under `no_sync()`) did reach it, its
`.grad` held that local sum when DDP reduced it in place, with no copy taken (its hook did not
run in the reduced pass): the step's agreement is then unknown and left out, said once.
"""

from __future__ import annotations

import logging

import torch

from ...runtime.step_context import StepContext
from .ddp_sync import DdpSync

logger = logging.getLogger("msmon")


def unused_here(
    ctx: StepContext, local: dict[int, torch.Tensor], counts: dict[int, int], sync: DdpSync | None
) -> list[int] | None:
    """At the end of a backward pass DDP reduced: the monitored parameters it reduced that this
    rank used in no micro-batch of the step so far and that have no local sum yet (their local
    gradient is zero). None when one it did use earlier in the step missed this pass (its local
    sum is gone; said once)."""
    if sync is None:
        return []
    unused = []
    for index, mp in enumerate(ctx.params):
        param = mp.param
        if index in local or not param.requires_grad or not sync.reduces(param):
            continue
        reduced = ctx.grad_of(param)
        if reduced is None or reduced.layout != torch.strided:
            continue  # unused on every rank: DDP left it alone
        if counts.get(index, 0):
            _say_unknown(ctx, mp.name)
            return None
        unused.append(index)
    return unused


_SAID = "grad_agreement: unused micro-batch"


def _say_unknown(ctx: StepContext, name: str) -> None:
    if _SAID in ctx.kept:
        return
    ctx.kept[_SAID] = True
    logger.warning(
        "msmon[rank %d]: grad_agreement of step %d is left out: %s was reached by an earlier micro-batch of "
        "the step but not by a later one that DDP reduced (find_unused_parameters), so its rank-local "
        "gradient was all-reduced in place before msmon could copy it (said once)",
        ctx.rank,
        ctx.step,
        name,
    )

"""Training order within a step, for "the first tensor where the runs part".

The weights a step starts from, then per micro-step its forward (activations in execution
order, and the loss), its backward (activation gradients in the order backward reached them),
then rank-local gradients, reduced gradients, the gradient agreement, optimizer state, update
and ratio, and the updated weights. Across pipeline stages the forward runs from the first stage
to the last and the backward back (the stage a rank's summary.json names, 0 when unknown);
within a rank, a row's position in its file is the order the monitor recorded it in.
"""

from __future__ import annotations

from .cells import Cell

# (phase, place): phase 0 before the micro-steps, 1 in each micro-step, 2 after them
CATEGORY_PLACE = {
    "param_origin": (0, 0),
    "actv": (1, 0),
    "attention_hook": (1, 0),
    "linear_hook": (1, 0),
    "moe_router_weight_hook": (1, 0),
    "moe_router_logit_hook": (1, 0),
    "loss": (1, 1),
    "actv_grad": (1, 2),
    "grad_unreduced": (2, 0),
    "grad_reduced": (2, 1),
    "grad_agreement": (2, 2),
    "exp_avg": (2, 3),
    "exp_avg_sq": (2, 3),
    "other": (2, 3),
    "update": (2, 4),
    "ratio": (2, 4),
    "param_updated": (2, 5),
}
BACKWARD = frozenset({"actv_grad"})
STATISTIC_ORDER = {"rank": 0, "tensor": 0, "min": 0, "median": 1, "max": 2}


def order_key(cell: Cell, position: int, pp_stage: int) -> tuple:
    """Sorts cells of one step in training order."""
    phase, place = CATEGORY_PLACE.get(cell.category, (2, 6))
    micro = max(cell.micro_step, 0) if phase == 1 else 0
    backward = cell.category in BACKWARD
    pipeline = (-pp_stage, -cell.vpp_stage) if backward else (pp_stage, cell.vpp_stage)
    return (
        cell.step,
        phase,
        micro,
        place,
        *pipeline,
        position,
        cell.name,
        cell.rank if cell.rank is not None else -1,
        STATISTIC_ORDER.get(cell.statistic, 3),
        cell.op,
    )

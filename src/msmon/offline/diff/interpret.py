"""What the first divergence implies, in one line, from where it is in training order and what
agreed before it at that step (the front): numerics in a module's forward or backward, the
data, the loss, the communication (reduced gradients differ while rank-local ones agree), the
optimizer or the learning rate (its state or the updated weights differ while the gradients
agree), or the starting weights."""

from __future__ import annotations

from .cells import Cell
from .findings import CategoryFront

GRADIENTS = ("grad_unreduced", "grad_reduced")
OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq", "update", "ratio", "other")
FEATURES = ("attention_hook", "linear_hook", "moe_router_weight_hook", "moe_router_logit_hook")


def interpret(first: Cell, step_front: dict[str, CategoryFront], first_step: int, first_module: bool) -> str:
    """`step_front`: the categories compared at the first divergence's step; `first_step`: the
    first step compared; `first_module`: whether the tensor is the first one the forward records."""

    def agrees(category: str) -> bool:
        front = step_front.get(category)
        return front is not None and front.compared > 0 and front.over == 0

    def recorded(category: str) -> bool:
        return category in step_front

    category, module = first.category, first.module()
    if category == "param_origin":
        if first.step == first_step:
            return "the starting weights differ: another initialisation, seed or checkpoint"
        return (
            f"the weights differ at the start of step {first.step} while everything recorded before agrees: "
            "something outside the optimizer step wrote them, or the steps in between were not recorded"
        )
    if category == "actv" or category in FEATURES:
        name = module or first.name
        if category == "actv" and first.name.endswith((".input", ".input_0")) and first_module:
            return (
                f"the data: the input of {name}, the first module the forward records, differs (the batch or its order)"
            )
        if category == "actv" and ".input" in first.name:
            return f"numerics before {name}'s forward: its input differs while every module before it agrees"
        return f"numerics in {name}'s forward: its {_slot(first)} differs while everything before it agrees"
    if category == "loss":
        before = "the forward activations agree" if recorded("actv") else "activations were not recorded"
        return f"the loss or its inputs: the loss differs while {before} (the loss function, the labels, its scaling)"
    if category == "actv_grad":
        name = module or first.name
        return f"numerics in {name}'s backward: its gradient differs while the forward and the backward before it agree"
    if category == "grad_unreduced":
        before = "the activations agree" if recorded("actv") else "activations were not recorded"
        return f"the weight gradients' computation: the rank-local gradient of {first.name} differs while {before}"
    if category in ("grad_reduced", "grad_agreement"):
        if agrees("grad_unreduced"):
            return (
                "the communication: the reduced gradient differs while the rank-local gradients agree "
                "(the all-reduce or reduce-scatter, or clipping and loss-scale unscaling after it)"
            )
        return (
            "the gradients: the reduced gradient differs (rank-local gradients not recorded, so the communication "
            "cannot be told from the computation)"
        )
    gradients = "the gradients agree" if any(agrees(c) for c in GRADIENTS) else "the gradients were not compared"
    if category in OPTIMIZER_STATE:
        return (
            f"the optimizer: its state differs while {gradients} "
            "(its hyperparameters, such as betas, eps or weight decay, or its kernel)"
        )
    if category == "param_updated":
        state = any(agrees(c) for c in OPTIMIZER_STATE)
        return f"the optimizer step or the learning rate: the updated weights differ while {gradients}" + (
            " and the optimizer state agrees" if state else ""
        )
    return f"{first.what()} differs first"


def _slot(cell: Cell) -> str:
    tail = cell.name.rsplit(".", 1)[-1]
    return tail if tail.startswith(("input", "output")) else "output"

"""Where an anomaly arises on the path the data takes through one training step (torch-free).

One step, in the order training makes its values:

    forward activations    each micro-step's module inputs and outputs, in execution order
    the loss               computed from the model's output
    activation gradients   the gradient from the loss back through the modules, in autograd's order
    rank-local gradients   the weights' gradients of this rank's batch (grad_unreduced)
    after the reduction    the data-parallel average every rank receives (grad_reduced; and
                           grad_agreement, which compares the two), the optimizer state (moments,
                           update, update/weight ratio) and the weights (param_origin,
                           param_updated), in the order the step recorded them

Up to the rank-local gradients each rank computes from its own batch and its own copy of the
model: those values are *rank-local*. From the reduction on, every rank holds what all ranks
sent, so a fault of one rank shows on all of them there: a NaN made by rank 1 reaches rank 0's
reduced gradient in the same step. That is what tells one rank's fault from all ranks' (see
fault_kind.py). A collective the script calls itself (cc_distribution's `{op}@{site}/post` rows)
mixes the ranks too: its output is not rank-local.

Within a micro-step, the pipeline position orders the rows as the analyser does: ascending in
forward, descending in backward (the last stage runs its backward first). A statistic of the
whole step (micro_step None: accumulated gradients, the reduction, the optimizer) comes after
every micro-step.

`PathEvent` is the small typed input: msmon analyse builds it from the dump's records, the
report from the database's, and a run-time decision can build it from an alert (RowKey and
call_id). It also says which tensor and module it is in words.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from ..records.rows import BACKWARD, CATEGORY_TEXT, FORWARD, LOSS, OPTIMIZER, OTHER
from .event import NAN_ORIGIN_RULE

FORWARD_ACTIVATIONS, THE_LOSS, ACTIVATION_GRADIENTS, LOCAL_GRADIENTS, AFTER_REDUCTION = range(5)
PHASES = ("forward activations", "the loss", "activation gradients", "rank-local gradients", "after the reduction")
_PHASE_OF_CATEGORY = {
    "actv": FORWARD_ACTIVATIONS,
    "attention_hook": FORWARD_ACTIVATIONS,
    "linear_hook": FORWARD_ACTIVATIONS,
    "moe_router_weight_hook": FORWARD_ACTIVATIONS,
    "moe_router_logit_hook": FORWARD_ACTIVATIONS,
    "loss": THE_LOSS,
    "actv_grad": ACTIVATION_GRADIENTS,
    "grad_unreduced": LOCAL_GRADIENTS,
    "pre_grad": LOCAL_GRADIENTS,  # msprobe's names
    "acc_grad": LOCAL_GRADIENTS,
    "grad_reduced": AFTER_REDUCTION,
    "post_grad": AFTER_REDUCTION,
    "grad_agreement": AFTER_REDUCTION,
    "exp_avg": AFTER_REDUCTION,
    "exp_avg_sq": AFTER_REDUCTION,
    "update": AFTER_REDUCTION,
    "ratio": AFTER_REDUCTION,
    "param_origin": AFTER_REDUCTION,
    "param_updated": AFTER_REDUCTION,
}
_PHASE_OF_STAGE = {FORWARD: FORWARD_ACTIVATIONS, BACKWARD: ACTIVATION_GRADIENTS, OPTIMIZER: AFTER_REDUCTION}
_BACKWARD_PHASES = (ACTIVATION_GRADIENTS, LOCAL_GRADIENTS)
_WEIGHT_SUFFIX = re.compile(r"\[\w+\]$")  # `fc1.weight[main]`: an fp32 main copy


@dataclass(frozen=True)
class PathEvent:
    """One anomaly of one rank, with what places it on the step's data path."""

    rank: int
    step: int
    category: str
    name: str
    rule: str = ""
    micro_step: int | None = None
    call_id: int = -1  # its row's place in the rank's step (execution order)
    stage: str = ""  # forward/backward/optimizer: places a category this module does not know
    pp_stage: int = 0
    vpp_stage: int = 0

    @classmethod
    def of(cls, record: Any) -> PathEvent:
        """The place of any record that has these fields by name: an alert seen online
        (anomaly/seen.py), an event read back from a dump (offline/analyse/events.py)."""
        return cls(*(getattr(record, f.name) for f in fields(cls)))

    @property
    def phase(self) -> int:
        """Its place on the data path (FORWARD_ACTIVATIONS ... AFTER_REDUCTION)."""
        found = _PHASE_OF_CATEGORY.get(self.category)
        if found is not None:
            return found
        return _PHASE_OF_STAGE.get(self.stage, AFTER_REDUCTION)

    @property
    def rank_local(self) -> bool:
        """Computed by this rank alone from its batch and its copy of the model."""
        if self.category == OTHER and self.name.endswith("/post"):
            return False  # the output of a collective the script called
        return self.phase <= LOCAL_GRADIENTS

    @property
    def is_origin(self) -> bool:
        return self.rule == NAN_ORIGIN_RULE

    def position(self) -> tuple:
        """Sorts the events of one step in training order (then the rank, for a stable order)."""
        micro = self.micro_step if self.micro_step is not None else math.inf
        pipeline = (
            (-self.vpp_stage, -self.pp_stage) if self.phase in _BACKWARD_PHASES else (self.vpp_stage, self.pp_stage)
        )
        return (micro, self.phase, *pipeline, self.call_id, 0 if self.is_origin else 1, self.rank)

    def module(self) -> str:
        """The module it belongs to: `fc2` for `fc2.output` and `fc2.weight`, `loss` for the loss."""
        return module_of(self.category, self.name)

    def what(self) -> str:
        """In words, e.g. "forward output of layers.1.fc2" or "reduced gradient of fc1.weight"."""
        return describe_tensor(self.category, self.name, self.stage)


def split_slot(name: str) -> tuple[str, str | None]:
    """("layers.1.fc2", "output") from "layers.1.fc2.output" (also .input_0, .output_grad)."""
    match = re.fullmatch(r"(?P<module>.+)\.(?P<slot>input|output)(?P<grad>_grad)?(?:_\d+)?", name)
    if not match:
        return name, None
    return match["module"], match["slot"] + (match["grad"] or "")


def module_of(category: str, name: str) -> str:
    if name == LOSS or category == "loss":
        return LOSS
    module, slot = split_slot(name)
    if slot is not None:
        return module
    if category in CATEGORY_TEXT or _PHASE_OF_CATEGORY.get(category, -1) >= LOCAL_GRADIENTS:
        parameter = _WEIGHT_SUFFIX.sub("", name)
        return parameter.rpartition(".")[0] or parameter  # the parameter's module
    return name


def describe_tensor(category: str, name: str, stage: str = "") -> str:
    """A recorded tensor in words, as `msmon analyse` names it."""
    module, slot = split_slot(name)
    if category == "actv_grad" and name == LOSS:
        return "gradient of the loss"
    if category == "actv" and slot:
        return f"forward {slot} of {module}"
    if category == "actv_grad" and slot:
        return f"backward {slot.replace('_grad', '')} gradient of {module}"
    if category == "loss" and name == "loss":
        return "loss"
    if category in CATEGORY_TEXT:
        return CATEGORY_TEXT[category].format(name)
    return f"{stage} {category} {name}".strip()


def arrived_at_input(event: PathEvent) -> bool:
    """A forward input: a value that reached a module as it was, made by no module (the data,
    or code outside the modules)."""
    return event.category == "actv" and split_slot(event.name)[1] == "input"

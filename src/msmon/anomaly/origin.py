"""Resolve the first non-finite origin of a step from its ordered finiteness flags.

Forward: the first module (in the order modules finish) whose output has a NaN/Inf while all
of its inputs in that call were finite. Backward: the first module, in autograd's order, whose
input gradient is non-finite while its output gradient was finite. Flags are per micro-step;
the earliest micro-step with an origin wins, forward before backward.

Made outside every module: a forward value already non-finite when it reached a module (the
data, functional code); in backward, a gradient no module made: the loss's (the gradient that
reached the model's output, flagged as `loss`), or else the first non-finite gradient of a
module's output or input; and last, after backward, a weight's gradient (a tensor hook on the
weight, a write into `.grad`). Each is named in the step it appears, not a step later where the
updated weights spread it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..records.rows import LOSS, RowKey

_AFTER_BACKWARD = 1 << 30  # weight gradients: after every micro-step's flags


@dataclass(frozen=True)
class Origin:
    stage: str  # "forward", "backward" or "optimizer" (a weight's gradient as the optimizer gets it)
    module: str  # module name (with call suffix `_1`... for repeated calls)
    tensor: str  # "{module}.output" (forward) or "{module}.input" (backward input_grad)
    vpp_stage: int
    micro_step: int | None
    call_id: int  # position of the flag within the step
    category: str = ""  # of the flag: actv, actv_grad or grad_reduced (a weight's gradient)
    arrived: bool = False  # made outside every module, non-finite when a module first saw it

    def describe(self) -> str:
        if self.tensor.endswith(".input") and self.stage == "forward":
            return (
                f"forward input of {self.module} (micro-step {self.micro_step}): already non-finite when it "
                f"arrived, made by code outside any module or by the data"
            )
        if self.tensor == LOSS:
            return (
                f"the loss (micro-step {self.micro_step}): its gradient reached the model's output non-finite, "
                f"made by the loss computed outside any module"
            )
        if self.category == "grad_reduced":
            return (
                f"gradient of {self.tensor}: non-finite as the optimizer gets it while every activation gradient "
                f"was finite, made outside any module (a tensor hook on the weight, a write into .grad, or "
                f"another rank's gradient through the all-reduce)"
            )
        if self.arrived:
            return (
                f"backward gradient of {self.tensor} (micro-step {self.micro_step}): already non-finite when it "
                f"arrived, made outside any module (by a tensor hook, or code between modules)"
            )
        what = "forward output" if self.stage == "forward" else "backward input_grad"
        return f"{what} of {self.module} (micro-step {self.micro_step})"


def _split(name: str) -> tuple[str, str]:
    module, _, slot = name.rpartition(".")
    return module, slot


def find_origin(keys: list[RowKey], finite: list[bool]) -> Origin | None:
    """The origin of the step's first NaN/Inf, or None when every flag is finite."""
    if all(finite):
        return None
    # group flags by (stage, micro, vpp, module call)
    inputs_ok: dict[tuple, bool] = {}
    first_bad_input: tuple[int, int, str] | None = None
    outputs_bad: dict[tuple, tuple[int, str]] = {}
    grad_out_ok: dict[tuple, bool] = {}
    grad_in_bad: dict[tuple, tuple[int, str]] = {}
    first_bad_grad: dict[int, tuple[int, RowKey]] = {}  # by micro-step: the first non-finite gradient
    loss_bad: dict[int, tuple[int, RowKey]] = {}
    first_bad_weight_grad: tuple[int, RowKey] | None = None
    for call_id, (key, ok) in enumerate(zip(keys, finite)):
        module, slot = _split(key.name)
        ident = (key.micro_step or 0, key.vpp_stage, module)
        if key.category == "grad_reduced":
            if not ok and first_bad_weight_grad is None:
                first_bad_weight_grad = (call_id, key)
            continue
        if key.category == "actv_grad":
            if not ok:
                first_bad_grad.setdefault(ident[0], (call_id, key))
            if key.name == LOSS:
                if not ok:
                    loss_bad.setdefault(ident[0], (call_id, key))
                continue
        if key.category == "actv":
            if slot == "input":
                inputs_ok[ident] = inputs_ok.get(ident, True) and ok
                if not ok and first_bad_input is None:
                    first_bad_input = (call_id, key.vpp_stage, key.name)
            elif not ok and ident not in outputs_bad:
                outputs_bad[ident] = (call_id, key.name)
        else:
            if slot == "output":
                grad_out_ok[ident] = grad_out_ok.get(ident, True) and ok
            elif not ok and ident not in grad_in_bad:
                grad_in_bad[ident] = (call_id, key.name)
    # (micro-step, stage, made by a module first, flag position): the earliest wins
    candidates: list[tuple[int, int, int, int, Origin]] = []
    for ident, (call_id, name) in outputs_bad.items():
        if inputs_ok.get(ident, True):
            micro, vpp, module = ident
            candidates.append((micro, 0, 0, call_id, Origin("forward", module, name, vpp, micro, call_id, "actv")))
    for ident, (call_id, name) in grad_in_bad.items():
        if grad_out_ok.get(ident, True):
            micro, vpp, module = ident
            origin = Origin("backward", module, name, vpp, micro, call_id, "actv_grad")
            candidates.append((micro, 1, 0, call_id, origin))
    if first_bad_input is not None:
        # made outside any module (or by the data): where it first entered a module
        call_id, vpp, name = first_bad_input
        micro = keys[call_id].micro_step or 0
        origin = Origin("forward", _split(name)[0], name, vpp, micro, call_id, "actv", arrived=True)
        candidates.append((micro, 0, 0, call_id, origin))
    for micro, (call_id, key) in first_bad_grad.items():
        # no module made it (those come first): the loss sent it, or code outside every module
        call_id, key = loss_bad.get(micro, (call_id, key))
        module = LOSS if key.name == LOSS else _split(key.name)[0]
        origin = Origin("backward", module, key.name, key.vpp_stage, micro, call_id, "actv_grad", arrived=True)
        candidates.append((micro, 1, 1, call_id, origin))
    if first_bad_weight_grad is not None:
        call_id, key = first_bad_weight_grad
        module = key.name.rpartition(".")[0] or key.name
        origin = Origin("optimizer", module, key.name, key.vpp_stage, None, call_id, "grad_reduced", arrived=True)
        candidates.append((_AFTER_BACKWARD, 2, 0, call_id, origin))
    if not candidates:
        return None
    return min(candidates, key=lambda c: c[:4])[4]

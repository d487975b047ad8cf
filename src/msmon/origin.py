"""Resolve the first non-finite origin of a step from its ordered finiteness flags.

Forward: the first module (in the order modules finish) whose output has a NaN/Inf while all
of its inputs in that call were finite. Backward: the first module, in autograd's order, whose
input gradient is non-finite while its output gradient was finite. Flags are per micro-step;
the earliest micro-step with an origin wins, forward before backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from .records import RowKey


@dataclass(frozen=True)
class Origin:
    stage: str  # "forward" or "backward"
    module: str  # module name (with call suffix `_1`... for repeated calls)
    tensor: str  # "{module}.output" (forward) or "{module}.input" (backward input_grad)
    vpp_stage: int
    micro_step: int
    call_id: int  # position of the flag within the step

    def describe(self) -> str:
        if self.tensor.endswith(".input") and self.stage == "forward":
            return (
                f"forward input of {self.module} (micro-step {self.micro_step}): already non-finite when it "
                f"arrived, made by code outside any module or by the data"
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
    for call_id, (key, ok) in enumerate(zip(keys, finite)):
        module, slot = _split(key.name)
        ident = (key.micro_step or 0, key.vpp_stage, module)
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
    candidates: list[tuple[int, int, int, Origin]] = []
    for ident, (call_id, name) in outputs_bad.items():
        if inputs_ok.get(ident, True):
            micro, vpp, module = ident
            candidates.append((micro, 0, call_id, Origin("forward", module, name, vpp, micro, call_id)))
    for ident, (call_id, name) in grad_in_bad.items():
        if grad_out_ok.get(ident, True):
            micro, vpp, module = ident
            candidates.append((micro, 1, call_id, Origin("backward", module, name, vpp, micro, call_id)))
    if first_bad_input is not None:
        # made outside any module (or by the data): where it first entered a module
        call_id, vpp, name = first_bad_input
        micro = keys[call_id].micro_step or 0
        candidates.append((micro, 0, call_id, Origin("forward", _split(name)[0], name, vpp, micro, call_id)))
    if not candidates:
        return None
    return min(candidates, key=lambda c: c[:3])[3]

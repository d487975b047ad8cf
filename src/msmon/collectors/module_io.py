"""How a module's inputs and outputs are seen: flattened tensors, and target specs applied.

Outputs can be tensors, tuples, lists, dicts, HF ModelOutput (an OrderedDict) or dataclasses,
nested; only tensors are kept, in a stable order. A target spec "tuple[N]:i" picks element i
of the top-level tuple; "tensor" or no spec keeps every tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from ..config import TensorSpec


def in_backward() -> bool:
    """True while the autograd engine is running: a module called now is checkpoint recomputation,
    not a new forward."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, depth first in order, containers nested up to 9 deep. A list
    built in one call per container and none per tensor: every module's inputs and outputs
    pass through here in a hook, twice with all_xy (generators cost a call per item)."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    _collect(value, found, 0)
    return found


def _collect(value: Any, found: list[torch.Tensor], depth: int) -> None:
    """Append the tensors inside `value` (not itself a tensor) at nesting `depth` to `found`."""
    if depth > 8:
        return
    if isinstance(value, (tuple, list)):
        items: Iterable[Any] = value
    elif isinstance(value, dict):
        items = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = (getattr(value, f.name, None) for f in dataclasses.fields(value))
    else:
        return
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        else:
            _collect(item, found, depth + 1)


def structure_of(value: Any) -> str:
    """The spec string that describes `value`: "tensor" or "tuple[N]"."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (tuple, list)):
        return f"tuple[{len(value)}]"
    if isinstance(value, dict):
        return f"tuple[{len(value)}]"
    return type(value).__name__


def select(value: Any, spec: TensorSpec | None) -> tuple[list[torch.Tensor], str | None]:
    """The tensors a spec selects, and a mismatch message when the value does not fit it."""
    if spec is None or spec.length is None:
        return tensors_in(value), None
    items = list(value.values()) if isinstance(value, dict) else value
    if isinstance(items, (tuple, list)):
        if spec.index >= len(items):
            return [], f"expected {spec.text} but the module gave a tuple of {len(items)}"
        return tensors_in(items[spec.index]), None
    if isinstance(value, torch.Tensor) and spec.index == 0:
        return [value], None
    return [], f"expected {spec.text} but the module gave {structure_of(value)}"


def describe(t: torch.Tensor) -> str:
    return f"size={tuple(t.shape)}, dtype={t.dtype}"


class CallCounter:
    """Which call of a module within a micro-step this is: 0 for the first, then 1, 2, ... (the
    one numbering of module calls, for activations and the NaN origin alike)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}  # id(module) -> (micro_step, calls so far)

    def next(self, module: object, micro: int) -> int:
        key = id(module)
        last = self._last.get(key)
        index = last[1] + 1 if last is not None and last[0] == micro else 0
        self._last[key] = (micro, index)
        return index

    def clear(self) -> None:
        self._last.clear()


def call_name(name: str, call: int) -> str:
    """The row name of a module's `call`-th call in a micro-step: `name`, then `name_1`, ..."""
    return name if call == 0 else f"{name}_{call}"

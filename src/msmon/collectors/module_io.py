"""How a module's inputs and outputs are seen: flattened tensors, and target specs applied.

Outputs can be tensors, tuples, lists, dicts, HF ModelOutput (an OrderedDict) or dataclasses,
nested; only tensors are kept, in a stable order. A target spec "tuple[N]:i" picks element i
of the top-level tuple; "tensor" or no spec keeps every tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from ..config import TensorSpec


def in_backward() -> bool:
    """True while the autograd engine is running: a module called now is checkpoint recomputation,
    not a new forward."""
    return torch._C._current_graph_task_id() != -1


def iter_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 8:
        return
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from iter_tensors(getattr(value, f.name, None), depth + 1)


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
        if spec is not None and not isinstance(value, torch.Tensor):
            tensors = list(iter_tensors(value))
            return tensors, None
        return list(iter_tensors(value)), None
    items = list(value.values()) if isinstance(value, dict) else value
    if isinstance(items, (tuple, list)):
        if spec.index >= len(items):
            return [], f"expected {spec.text} but the module gave a tuple of {len(items)}"
        return list(iter_tensors(items[spec.index])), None
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

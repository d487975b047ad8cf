"""print_struct: the module tree with the shapes and dtypes of every input, output and grad.

Recorded during the first step, written to `module_struct/rank{r}/module_struct.json`; the
"config" strings are exactly what `targets` accepts.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..output.artifacts import write_artifact
from ..runtime.step_context import StepContext
from ..seams import guest_hooks
from .base import Collector
from .module_io import describe, in_backward, structure_of, tensors_in
from .registry import WRITES_MODULE_TREE, register

STRUCT = "structure"  # the registry key of StructCollector


@register(
    key=STRUCT,
    category="module",
    order=20,
    module_hooks=True,
    enabled=lambda cfg, ctx: cfg.print_struct,
    serves=WRITES_MODULE_TREE,
)
class StructCollector(Collector):
    name = "module structure"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        chunked = len(ctx.models) > 1
        self.modules = [
            (m, (f"{c}:{n}" if chunked else n)) for c, named in enumerate(ctx.names()[0]) for n, m in named.items() if n
        ]
        self.struct: dict[str, dict[str, dict[str, str]]] = {}

    def attach(self) -> None:
        for module, name in self.modules:
            self.struct.setdefault(name, {})
            self.handles.append(guest_hooks.forward_pre_hook(module, self.guard(self._pre(name)), with_kwargs=True))
            self.handles.append(guest_hooks.forward_hook(module, self.guard(self._post(name)), with_kwargs=True))

    def _entry(self, value: Any) -> dict[str, str]:
        entry = {"config": structure_of(value)}
        for i, t in enumerate(tensors_in(value)):
            entry[str(i)] = describe(t)
        return entry

    def _pre(self, name: str):
        def pre_hook(module, args, kwargs):
            if in_backward() or "input" in self.struct[name]:
                return None
            value = args if not kwargs else args + tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            value = value[0] if len(value) == 1 else value
            self.struct[name]["input"] = self._entry(value)
            self._grad_hooks(name, "input_grad", value)
            return None

        return pre_hook

    def _post(self, name: str):
        def post_hook(module, args, kwargs, output):
            if in_backward() or "output" in self.struct[name]:
                return None
            self.struct[name]["output"] = self._entry(output)
            self._grad_hooks(name, "output_grad", output)
            return None

        return post_hook

    def _grad_hooks(self, name: str, slot: str, value: Any) -> None:
        tensors = [t for t in tensors_in(value) if t.requires_grad]
        if not tensors or not torch.is_grad_enabled():
            return
        config = structure_of(value)
        grads: dict[str, str] = {"config": config}
        self.struct[name][slot] = grads
        for i, t in enumerate(tensors_in(value)):
            if t.requires_grad:
                t.register_hook(self.guard(self._grad_hook(grads, i)))

    @staticmethod
    def _grad_hook(entry: dict[str, str], index: int):
        def hook(grad):
            if grad is not None:
                entry[str(index)] = describe(grad)
            return None

        return hook

    def write(self, base_dir: str) -> str:
        out_dir = os.path.join(base_dir, "module_struct", f"rank{self.ctx.rank}")
        return write_artifact(out_dir, "module_struct.json", json.dumps(self.struct, indent=2), make_directory=True)

    def render_tree(self) -> str:
        lines = []
        for name, entry in self.struct.items():
            depth = name.count(".") if name else 0
            label = name or "(root)"  # the whole dotted name: what `targets` takes, ready to copy
            parts = []
            for slot in ("input", "output"):
                if slot in entry:
                    shapes = [v for k, v in entry[slot].items() if k != "config"]
                    parts.append(f"{slot} {entry[slot]['config']}: " + "; ".join(shapes))
            lines.append("  " * depth + label + (f"  [{' | '.join(parts)}]" if parts else ""))
        return "\n".join(lines)

"""L2 features (`recording_l2_features` with `l2_targets`), msprobe's four hooks.

- attention_hook: a module whose forward receives q and k (its first two positional
  arguments, or `query`/`key` keywords), laid out as `sa_order`: attention entropy and
  softmax max per micro-step, over a fixed seeded sample of query rows of every head.
- linear_hook: a module's 2-D `weight` (or `wg`): spectral norm (`kernel_norm`) by power
  iteration over a block of vectors warm-started from the previous step's (kept on the
  device), and stable rank (`sr`) = ‖W‖²_F/‖W‖²₂, once per step; `"linear_hook": []` takes
  every such module but embeddings.
- moe_router_weight_hook: mean pairwise cosine similarity of the router weight's expert
  vectors, once per step.
- moe_router_logit_hook: mean per-token entropy of the softmax over experts of the module's
  output (its first floating-point tensor), per micro-step.

The math is tensor_math.py. Hooks compute on the device and add one-value rows to the step
buffer (RowKey.op names the value); nothing is read on the host, and the rows travel in the
step's one copy. A DTensor (tensor parallelism) is read as this rank's shard: no hook runs a
collective. Like activations, forwards in eval mode, under no_grad, in a closure's later
evaluations or in checkpoint recomputation are skipped.
"""

from __future__ import annotations

import logging
import weakref
import zlib
from typing import Any, cast

import torch

from ...records.rows import RowKey
from ...runtime.step_context import StepContext
from ...seams import guest_hooks
from ...stats.inputs import local_tensor
from ..base import Collector
from ..module_io import in_backward, tensors_in
from ..registry import register
from . import tensor_math as l2_math
from .targets import l2_enabled, l2_targets_fit, resolve_targets, weight_2d

logger = logging.getLogger("msmon")

_QUERY_KEYWORDS, _KEY_KEYWORDS = ("query", "query_layer", "q"), ("key", "key_layer", "k")
# power-iteration vectors by module, kept across collector rebuilds (a config reload) and
# released with the module
_VECTORS: weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def _first_two(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """q and k: the first two positional arguments, else the usual keywords."""
    q = args[0] if len(args) > 0 else next((kwargs[k] for k in _QUERY_KEYWORDS if k in kwargs), None)
    k = args[1] if len(args) > 1 else next((kwargs[k] for k in _KEY_KEYWORDS if k in kwargs), None)
    return q, k


@register(key="l2_features", category="module", order=60, module_hooks=True, enabled=l2_enabled, fits=l2_targets_fit)
class L2FeatureCollector(Collector):
    name = "L2 features"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self.targets = resolve_targets(ctx.config, ctx.names()[0])
        self.order = ctx.config.sa_order
        self._done: set[tuple[str, int]] = set()  # (hook, id(module)) weight features taken this step
        self._positions: dict[tuple, torch.Tensor | None] = {}
        self._generators: dict[tuple[str, str], torch.Generator] = {}
        self._warned: set[tuple[str, str]] = set()

    def attach(self) -> None:
        makers = {
            "attention_hook": self._attention_hook,
            "linear_hook": self._linear_hook,
            "moe_router_weight_hook": self._router_weight_hook,
            "moe_router_logit_hook": self._router_logit_hook,
        }
        for hook, module, name, chunk in self.targets:
            fn = self.guard(makers[hook](name, chunk))
            if hook == "attention_hook":
                self.handles.append(guest_hooks.forward_pre_hook(module, fn, with_kwargs=True))
            else:
                self.handles.append(guest_hooks.forward_hook(module, fn))

    def end_step(self) -> None:
        self._done.clear()

    # -- helpers ------------------------------------------------------------------------------
    def _active(self, module: torch.nn.Module, chunk: int) -> bool:
        ctx = self.ctx
        return ctx.recording and module.training and not in_backward() and not ctx.in_gradless_forward(chunk)

    def _add(self, category: str, name: str, chunk: int, micro: int | None, values: dict[str, torch.Tensor]) -> None:
        width = len(self.ctx.step_ops)
        for op, value in values.items():
            row = value.detach().to(torch.float64).reshape(1).expand(width)
            self.ctx.buffer.add(RowKey(category, name, chunk, micro, op=op), row)

    def _warn_once(self, hook: str, name: str, problem: str) -> None:
        if (hook, name) not in self._warned:
            self._warned.add((hook, name))
            logger.warning(
                "msmon[rank %d]: l2_targets[%r] %s: %s; nothing recorded for it", self.ctx.rank, hook, name, problem
            )

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        """A generator of its own per module and device, seeded from the module's name: the
        training's random streams are never touched, and every run samples the same."""
        key = (name, str(device))
        gen = self._generators.get(key)
        if gen is None:
            gen = self._generators[key] = torch.Generator(device=device)
            gen.manual_seed(zlib.crc32(name.encode()))
        return gen

    # -- hooks --------------------------------------------------------------------------------
    def _attention_hook(self, name: str, chunk: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._active(module, chunk):
                return None
            q, k = _first_two(args, kwargs)
            if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
                self._warn_once("attention_hook", name, "its forward does not receive q and k tensors first")
                return None
            q, k = local_tensor(q), local_tensor(k)
            try:
                with torch.no_grad():
                    entropy, top = self._attention(name, q, k)
            except ValueError as exc:
                self._warn_once("attention_hook", name, f"{exc} (sa_order is {self.order!r})")
                return None
            self._add(
                "attention_hook",
                f"{name}.attention",
                chunk,
                self.ctx.forward_micro_step(chunk),
                {"entropy": entropy, "softmax_max": top},
            )
            return None

        return hook

    def _attention(self, name: str, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The features over this module's fixed row sample (drawn once per shape)."""
        b, hq, sq, _ = l2_math.to_bhsd(q, self.order).shape
        used, rows = l2_math.attention_rows(b, hq, sq, l2_math.to_bhsd(k, self.order).shape[2])
        key = (name, hq, sq, rows, str(q.device))
        if key not in self._positions:
            self._positions[key] = l2_math.sample_positions(hq, sq, rows, self._generator(name, q.device), q.device)
        return l2_math.attention_features(q, k, self.order, self._positions[key], used)

    def _once_per_step(self, hook: str, module: torch.nn.Module, chunk: int) -> bool:
        if not self._active(module, chunk) or (hook, id(module)) in self._done:
            return False
        self._done.add((hook, id(module)))
        return True

    def _linear_hook(self, name: str, chunk: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not self._once_per_step("linear_hook", module, chunk):
                return None
            w = weight_2d(module)
            if w is None or w.numel() == 0:
                return None
            with torch.no_grad():
                w = w.detach()
                start, iterations = self._start_basis(module, name, w)
                sigma, _VECTORS[module] = l2_math.spectral_norm(w, start, iterations)
                fro = l2_math.frobenius_norm(w)
            self._add(
                "linear_hook",
                f"{name}.linear",
                chunk,
                None,
                {"sr": l2_math.stable_rank(fro, sigma), "kernel_norm": sigma},
            )
            return None

        return hook

    def _start_basis(self, module: torch.nn.Module, name: str, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(start vectors, iterations): last step's, kept on the device, and one iteration; the
        first time (or when the weight changed shape, dtype or device) vectors from the
        module's own seeded generator and the cold-start iterations."""
        dtype = l2_math._vector_dtype(w)
        kept = _VECTORS.get(module)
        if kept is not None and kept.shape[0] == w.shape[1] and kept.device == w.device and kept.dtype == dtype:
            return kept, l2_math.WARM_ITERATIONS
        return (
            l2_math.seed_basis(w.shape[1], self._generator(name, w.device), w.device, dtype),
            l2_math.COLD_ITERATIONS,
        )

    def _router_weight_hook(self, name: str, chunk: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not self._once_per_step("moe_router_weight_hook", module, chunk):
                return None
            w = cast(torch.Tensor, weight_2d(module))  # resolve_targets refused modules without a 2-D weight
            out = next((t for t in tensors_in(output) if t.is_floating_point() and t.dim() >= 1), None)
            axis = l2_math.expert_axis(w.shape, out.shape[-1] if out is not None else None)
            if w.shape[axis] < 2:
                self._warn_once("moe_router_weight_hook", name, f"its weight {tuple(w.shape)} has fewer than 2 experts")
                return None
            with torch.no_grad():
                value = l2_math.router_weight_similarity(w, axis)
            self._add("moe_router_weight_hook", f"{name}.moe_router", chunk, None, {"router_weight_similarity": value})
            return None

        return hook

    def _router_logit_hook(self, name: str, chunk: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if not self._active(module, chunk):
                return None
            logits = next((local_tensor(t) for t in tensors_in(output) if t.is_floating_point()), None)
            if logits is None or logits.dim() < 2 or logits.shape[-1] < 1 or logits.numel() == 0:
                shape = None if logits is None else tuple(logits.shape)
                self._warn_once(
                    "moe_router_logit_hook",
                    name,
                    f"its output has no [tokens, experts] floating-point tensor (got {shape})",
                )
                return None
            with torch.no_grad():
                value = l2_math.router_logit_entropy(logits)
            self._add(
                "moe_router_logit_hook",
                f"{name}.moe_router",
                chunk,
                self.ctx.forward_micro_step(chunk),
                {"per_token_expert_entropy": value},
            )
            return None

        return hook

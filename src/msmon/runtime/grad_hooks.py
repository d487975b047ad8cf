"""One gradient hook per activation tensor and step, shared by every collector that wants it.

The activation collector and the non-finite origin each want the gradient of every module's
input and output, and one module's output is usually the next one's input: four hooks per
tensor, each a `Tensor.register_hook` (a RemovableHandle, a hook dict), two closures and a call
from the autograd engine into Python. Here the first request registers one hook, later ones
for the same tensor join its list, and the hook calls them in the order they were asked for,
with the same gradient each would have received. The same tensor means the same object (a
weak reference says) at the same version: after an in-place op (ReLU(inplace=True)) a hook
gets the gradient of the new value, one registered before it that of the old. A
failing callback switches its own collector off (ctx.report_failure), as its own guard did.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from ..records.rows import RowKey
from ..seams.guest_hooks import interpreter_stack, is_compiling, tracing_state
from .cost import CostMeter
from .step_collector import StepCollector as Collector
from .tensor_memo import TensorMemo

GradCallback = Callable[[RowKey, torch.Tensor], None]


class HookOwner(Protocol):
    """What the hooks need of the step context (step_context.py's StepContext, which holds them)."""

    cost: CostMeter

    def report_failure(self, collector: Collector, exc: BaseException) -> None: ...


class GradHooks:
    __slots__ = ("_ctx", "_hooked")

    def __init__(self, ctx: HookOwner) -> None:
        self._ctx = ctx
        self._hooked: TensorMemo[list[tuple[Collector, GradCallback, RowKey]]] = TensorMemo()

    def add(self, t: torch.Tensor, collector: Collector, callback: GradCallback, key: RowKey) -> None:
        """Call `callback(key, grad)` with the gradient of `t` in backward (if `collector` is
        still on then)."""
        calls = self._hooked.get(t)
        if calls is not None:
            calls.append((collector, callback, key))
            return
        calls = [(collector, callback, key)]
        t.register_hook(self._hook(calls))
        self._hooked.put(t, calls)

    def clear(self) -> None:
        """Forget this step's tensors (their hooks stay, and still call back if they fire)."""
        self._hooked.clear()

    def _hook(self, calls: list[tuple[Collector, GradCallback, RowKey]]) -> Callable[[torch.Tensor], None]:
        ctx = self._ctx
        clock = time.perf_counter

        def msmon_grad_hook(grad: torch.Tensor) -> None:
            # inside a torch.compile trace the hook is a no-op the tracer folds away; inside
            # torch.jit.trace or a torch.func transform it steps aside (guest_hooks.transform_running)
            if is_compiling() or tracing_state() is not None or interpreter_stack() is not None:
                return None
            started = clock()
            try:
                for collector, callback, key in calls:
                    if collector.enabled:
                        try:
                            callback(key, grad)
                        except Exception as exc:  # contained: monitoring must never break training
                            ctx.report_failure(collector, exc)
            finally:
                ctx.cost.seconds += clock() - started
            return None

        # a tensor's hooks are never pickled (torch.utils.hooks.unserializable_hook)
        msmon_grad_hook.__torch_unserializable__ = True  # type: ignore[attr-defined]
        return msmon_grad_hook

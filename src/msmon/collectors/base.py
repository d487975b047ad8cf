"""The collector base: hook bookkeeping and failure containment."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from ..runtime.selection import MonitoredParam
from ..seams.guest_hooks import interpreter_stack, is_compiling, tracing_state, transform_running

if TYPE_CHECKING:
    from ..runtime.step_context import StepContext


# Marks a post-accumulate-grad hook of msmon's that only notes that it ran: it reads and writes
# no gradient, so it does not stop the gradients from being read in one batch at the end of
# backward (GradCollector._can_wait counts the other hooks on a parameter)
READS_NOTHING = "__msmon_reads_nothing__"


class Collector:
    """Registers hooks on attach, removes them on detach. Any exception inside a hook or a
    step callback switches this collector off (logged once, ctx.report_failure); training goes on.

    A collector sees the monitor's StepContext only (`self.ctx`); it registers itself with
    collectors.registry."""

    name = "collector"
    key = ""  # set by collectors.registry.register

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.handles: list[Any] = []
        self.enabled = True
        self.stepped_aside: str | None = None  # the last transform a hook of this one stepped aside in

    def attach(self) -> None:
        """Register hooks."""

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def before_update(self) -> None:
        """Gradients are final; the optimizer has not touched anything yet."""

    def after_update(self) -> None:
        """The optimizer step is done."""

    def end_step(self) -> None:
        """Reset per-step state (called for recorded and unrecorded steps alike)."""

    def step_skipped(self) -> None:
        """The iteration ended with no optimizer step (a GradScaler skipped it): forget it as a
        step's end forgets the step; nothing of it is recorded."""
        self.end_step()

    def guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap a hook so a failure disables this collector instead of breaking training."""

        clock = time.perf_counter
        ctx = self.ctx

        def guarded(*args: Any, **kwargs: Any) -> Any:
            # inside a torch.compile trace the hook is a no-op the tracer folds away, so it
            # causes no graph break (compiled regions are not recorded; see the monitor's note);
            # inside torch.jit.trace or a torch.func transform it steps aside too (transform_running)
            if not self.enabled or is_compiling():  # first, and alone: nothing for the tracer to replay
                return None
            if tracing_state() is not None or interpreter_stack() is not None:
                self.stepped_aside = transform_running()
                return None
            started = clock()
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # contained: monitoring must never break training
                ctx.report_failure(self, exc)
                return None
            finally:
                ctx.cost.seconds += clock() - started

        # the name only (functools.wraps costs more than the hook itself: one is made per
        # activation gradient per step)
        guarded.__name__ = guarded.__qualname__ = getattr(fn, "__name__", "hook")
        # a tensor's hooks are never pickled; this keeps torch.save(tensor) of a monitored
        # activation from warning about msmon's (torch.utils.hooks.unserializable_hook)
        guarded.__torch_unserializable__ = True  # type: ignore[attr-defined]
        return guarded


__all__ = ["Collector", "MonitoredParam"]

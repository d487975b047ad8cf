"""Where DeepSpeed's stage 0 reduces whole gradients (layout of deepspeed 0.19), for the
gradient agreement (collectors/grads/agreement.py).

Without ZeRO (stage 0) the engine, not a torch DDP module, all-reduces the gradients: at the
end of every backward pass (`_backward_epilogue`, or `step()` when the script drives the
accumulation itself) it calls `allreduce_gradients`, which at an accumulation boundary
averages every parameter's `.grad` in place over the data-parallel group
(`buffered_allreduce_fallback`: flatten, all-reduce, copy back). Before that call `.grad`
holds the rank's own gradient of the step, after it the whole average: both tensors the
agreement needs, on this rank, with no collective of msmon's. `allreduce_gradients` is wrapped
on the engine instance (the class and other engines are untouched).

Not here: ZeRO-1/2 (`DeepSpeedZeroOptimizer`) copy back each reduced bucket only into the
slices of the partition this rank owns (`allreduce_and_copy_with_multiple_ranks`, or a
`reduce` to the owner), so no rank keeps the whole reduced gradient; ZeRO-3 partitions the
gradient itself; `BF16_Optimizer` reduces its own fp32 accumulation buffers, which this does
not follow.
"""

from __future__ import annotations

from typing import Any, Callable

from ...seams.patching import wrap_method
from ...seams.reduction_seam import stop_following

# the optimizers of stage 0 whose gradients the engine reduces in `.grad` (a torch optimizer, or
# FP16_UnfusedOptimizer over the bit16 parameters); BF16_Optimizer reduces its own buffers
_OWN_BUFFERS = frozenset({"BF16_Optimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"})


def engine_of(models: list[Any]) -> Any:
    """The DeepSpeed engine among the monitored models (by its methods: DeepSpeed stays unimported)."""
    for model in models:
        if callable(getattr(model, "allreduce_gradients", None)) and callable(
            getattr(model, "zero_optimization_stage", None)
        ):
            return model
    return None


def _reduces_now(engine: Any) -> bool:
    """Whether this `allreduce_gradients` call averages `.grad` (stage 0 reduces only at an
    accumulation boundary; DeepCompile reduces inside its compiled graph instead)."""
    compiled = getattr(engine, "is_deepcompile_active", None)
    if compiled is not None and compiled() and not engine.uses_parallelization_pass_only():
        return False
    return bool(engine.is_gradient_accumulation_boundary())


def whole_gradient_reduction(
    models: list[Any], optimizer: Any, before: Callable[[list[Any] | None], None], after: Callable[[], None]
) -> Callable[[], None] | None:
    """Call `before(None)` (every parameter) and `after()` around the stage-0 engine's reduction of `.grad`; None
    (nothing wrapped) for ZeRO stages 1-3 and BF16_Optimizer (module docstring)."""
    engine = engine_of(models)
    if engine is None or engine.zero_optimization_stage() != 0 or type(optimizer).__name__ in _OWN_BUFFERS:
        return None
    if type(getattr(engine, "optimizer", None)).__name__ in _OWN_BUFFERS:
        return None
    state = {"reducing": False, "failed": False}

    def on_before(*_args: Any, **_kwargs: Any) -> None:
        state["reducing"] = False
        if state["failed"]:
            return
        try:
            state["reducing"] = _reduces_now(engine)
        except Exception as exc:  # an engine of another layout: the agreement is off, training goes on
            stop_following(state, "tell when DeepSpeed reduces gradients", exc)
            return
        if state["reducing"]:
            before(None)

    def on_after(_result: Any, *_args: Any, **_kwargs: Any) -> None:
        if state["reducing"]:
            state["reducing"] = False
            after()

    return wrap_method(engine, "allreduce_gradients", before=on_before, after=on_after)

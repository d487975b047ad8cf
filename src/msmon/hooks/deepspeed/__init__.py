"""DeepSpeed: everything msmon knows about it.

- instrumentor.py: attach to the optimizer every `deepspeed.initialize` builds;
- adapters.py: read the weights, gradients and moments of its optimizers (stage 0, ZeRO-1/2/3);
- groups.py: its data-, tensor- and pipeline-parallel groups, for the write-once rule.

Light on import (never imports DeepSpeed, nor the monitor): it exports its `FRAMEWORK` spec
(seams/spec.py), which the adapter choice, dedupe.py and the pipeline position read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ...seams.spec import EXPERT_PARAMETER, Framework

if TYPE_CHECKING:
    from ...seams.adapters import OptimizerAdapter
    from ...seams.backward_calls import LossScaling
    from ...seams.parallel_groups import ParallelGroups
    from ...seams.spec import Position
    from .. import Session

__all__ = ["EXPERT_PARAMETER", "FRAMEWORK", "adapter_for", "instrument", "replica_exclusion", "uninstrument"]

# DeepSpeed's optimizer classes drive an inner torch optimizer (`.optimizer`): not wrappers
_OPTIMIZER_CLASSES = frozenset(
    {
        "DeepSpeedZeroOptimizer",
        "DeepSpeedZeroOptimizer_Stage3",
        "BF16_Optimizer",
        "FP16_UnfusedOptimizer",
        "FP16_Optimizer",
    }
)

# msprobe's opt_ty names -> the adapters that fit them
_OPT_TY: dict[str, tuple[str, ...]] = {
    "DeepSpeedZeroOptimizer_Stage0": ("BF16Adapter", "FP16UnfusedAdapter", "TorchOptimAdapter"),
    "DeepSpeedZeroOptimizer_Stage1_or_2": ("Zero12Adapter",),
    "DeepSpeedZeroOptimizer_Stage3": ("Zero3Adapter",),
}


def instrument(session: Session) -> None:
    from . import instrumentor

    instrumentor.instrument(session)


def uninstrument() -> None:
    from . import instrumentor

    instrumentor.uninstrument()


def replica_exclusion(models: list[Any], optimizer: Any, weights: bool) -> Callable[[Any], str | None]:
    """The replica check's exceptions: ZeRO-3 parameters are each rank's own partition; MoE
    expert parameters (`allreduce=False`, as DeepSpeed and Megatron mark them) are replicated
    over their expert-data-parallel group only. Attribute checks only: any optimizer."""

    def why(param: Any) -> str | None:
        if hasattr(param, "ds_tensor"):
            return "partitioned by ZeRO-3: each rank holds its own partition"
        if getattr(param, "allreduce", True) is False:
            return EXPERT_PARAMETER
        return None

    return why


def adapter_for(optimizer: Any) -> OptimizerAdapter | None:
    """The adapter of a DeepSpeed optimizer (chosen by class name), None for any other."""
    from .adapters import deepspeed_adapter

    return deepspeed_adapter(optimizer)


def loss_scaling() -> LossScaling:
    """DeepSpeed's `engine.backward(loss)` takes the script's loss and runs backward on it
    divided by the accumulation steps and, in fp16, multiplied by the loss scale; its
    torch-style path, `engine.scale(loss).backward()` (ZeRO only), returns the loss times the
    loss scale (fp16's scaler, or torch's GradScaler under `torch_autocast` float16) and leaves
    the division to its own hooks: `scale` is a scaler like torch's `GradScaler.scale`."""
    from ...seams.backward_calls import EntryPoint, LossScaling, Scaler
    from ...seams.library import library

    DeepSpeedEngine = library("deepspeed.runtime.engine").DeepSpeedEngine

    return LossScaling(
        scalers=(Scaler(DeepSpeedEngine, "scale", _loss_scale_of),),
        entry_points=(EntryPoint(DeepSpeedEngine, "backward"),),
    )


def _loss_scale_of(engine: Any) -> Any:
    """The scale `engine.scale` applied (attributes only, nothing read on the host): torch's
    GradScaler's under torch_autocast, else the fp16 optimizer's `loss_scale`, else None."""
    optimizer = getattr(engine, "optimizer", None)
    for scaler in (
        getattr(optimizer, "torch_autocast_gradscaler", None),
        getattr(engine, "torch_autocast_z0_gradscaler", None),
    ):
        if scaler is not None:
            return scaler._scale
    return getattr(optimizer, "loss_scale", None)


def groups_of_models(found: ParallelGroups, models: list[Any], adapter: Any) -> None:
    from . import groups

    groups.groups_of_models(found, models, adapter)


def pipeline_position() -> Position | None:
    from . import groups

    return groups.pipeline_position()


def whole_gradient_reduction(
    models: list[Any], optimizer: Any, before: Callable[[list[Any] | None], None], after: Callable[[], None]
) -> Callable[[], None] | None:
    """Stage 0's engine all-reduces `.grad` itself: `before`/`after` around it (reduction.py)."""
    from .reduction import whole_gradient_reduction as wrap

    return wrap(models, optimizer, before, after)


FRAMEWORK = Framework(
    name="deepspeed",
    switched_on_by="deepspeed",
    precedence=20,
    distribution="deepspeed",
    supported=">=0.17,<0.20",  # the layout of adapters.py; tested on 0.19.8
    instrument=instrument,
    uninstrument=uninstrument,
    adapter_for=adapter_for,
    optimizer_classes=_OPTIMIZER_CLASSES,
    opt_ty=_OPT_TY,
    groups_of_models=groups_of_models,
    pipeline_position=pipeline_position,
    replica_exclusion=replica_exclusion,
    loss_scaling=loss_scaling,
    whole_gradient_reduction=whole_gradient_reduction,
)

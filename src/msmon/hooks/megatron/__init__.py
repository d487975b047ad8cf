"""Megatron (megatron-core, and Megatron-LM's training loop): everything msmon knows about it.

- instrumentor.py: attach to the optimizer `get_megatron_optimizer` / `setup_model_and_optimizer` build;
- adapters.py: read FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer and
  ChainedOptimizer, and the rank-local gradients at a bucket group's grad sync;
- groups.py: its data-, tensor- and pipeline-parallel groups (`parallel_state`).

Light on import (never imports Megatron, nor the monitor): it exports its `FRAMEWORK` spec
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

__all__ = ["FRAMEWORK", "adapter_for", "instrument", "replica_exclusion", "uninstrument"]

# Megatron's optimizer classes drive an inner torch optimizer (`.optimizer`): not wrappers
_OPTIMIZER_CLASSES = frozenset({"MegatronOptimizer", "ChainedOptimizer"})

# msprobe's opt_ty names -> the adapters that fit them
_OPT_TY: dict[str, tuple[str, ...]] = {
    "Megatron_FP32Optimizer": ("FP32Adapter",),
    "Megatron_Float16OptimizerWithFloat16Params": ("Float16Adapter",),
    "Megatron_DistributedOptimizer": ("DistributedAdapter",),
    "Megatron_ChainedFloat16OptimizerWithFloat16Params": ("Float16Adapter",),
    "Megatron_ChainedDistributedOptimizer": ("DistributedAdapter",),
}


def instrument(session: Session) -> None:
    from . import instrumentor

    instrumentor.instrument(session)


def uninstrument() -> None:
    from . import instrumentor

    instrumentor.uninstrument()


def replica_exclusion(models: list[Any], optimizer: Any, weights: bool) -> Callable[[Any], str | None] | None:
    """The replica check's exceptions under a Megatron optimizer: expert parameters
    (`allreduce=False`) are replicated over their expert-data-parallel group only; with the
    distributed optimizer's overlap_param_gather, each rank's model weights are updated only in
    the next forward, so right after the step they differ by design."""
    from ...seams.adapters import class_names

    names = class_names(optimizer)
    if not _OPTIMIZER_CLASSES & set(names):
        return None
    lazy = (
        weights
        and "DistributedOptimizer" in names
        and any(getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False) for chunk in models)
    )

    def why(param: Any) -> str | None:
        if getattr(param, "allreduce", True) is False:
            return EXPERT_PARAMETER
        if lazy:
            return "gathered in the next forward (Megatron overlap_param_gather), not after the step"
        return None

    return why


def groups_of_process(found: ParallelGroups) -> None:
    from . import groups

    groups.groups_of_process(found)


def pipeline_position() -> Position | None:
    from . import groups

    return groups.pipeline_position()


def whole_gradient_reduction(
    models: list[Any], optimizer: Any, before: Callable[[list[Any] | None], None], after: Callable[[], None]
) -> Callable[[], None] | None:
    """Megatron's DDP all-reduces `main_grad` per bucket group without the distributed
    optimizer: `before`/`after` around it (reduction.py)."""
    from .reduction import whole_gradient_reduction as wrap

    return wrap(models, optimizer, before, after)


def adapter_for(optimizer: Any) -> OptimizerAdapter | None:
    """The adapter of a Megatron optimizer (chosen by class name), None for any other."""
    from .adapters import megatron_adapter

    return megatron_adapter(optimizer)


def loss_scaling() -> LossScaling:
    """Megatron's `grad_scale_func` is its optimizer's `scale_loss(loss) = get_loss_scale() * loss`
    (each class that defines its own is wrapped); its `custom_backward(output, grad)` runs the
    autograd engine directly, so it is watched as well."""
    from ...seams.backward_calls import EntryPoint, LossScaling, Scaler
    from ...seams.library import library

    classes, todo = [], [library("megatron.core.optimizer.optimizer").MegatronOptimizer]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    scale_of = lambda optimizer: optimizer.get_loss_scale()  # noqa: E731
    schedules = library("megatron.core.pipeline_parallel.schedules")
    return LossScaling(
        scalers=tuple(Scaler(cls, "scale_loss", scale_of) for cls in classes if "scale_loss" in cls.__dict__),
        # with deallocate_pipeline_outputs, backward_step runs the engine itself, not through backward
        entry_points=(EntryPoint(schedules, "custom_backward", method=False),),
    )


FRAMEWORK = Framework(
    name="megatron",
    switched_on_by="megatron.core",
    precedence=10,
    distribution="megatron-core",
    supported=">=0.16,<0.17",  # the layout of adapters.py; tested on 0.16.1
    instrument=instrument,
    uninstrument=uninstrument,
    adapter_for=adapter_for,
    optimizer_classes=_OPTIMIZER_CLASSES,
    opt_ty=_OPT_TY,
    groups_of_process=groups_of_process,
    pipeline_position=pipeline_position,
    replica_exclusion=replica_exclusion,
    loss_scaling=loss_scaling,
    whole_gradient_reduction=whole_gradient_reduction,
)

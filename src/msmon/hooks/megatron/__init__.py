"""Megatron (megatron-core, and Megatron-LM's training loop): everything msmon knows about it.

- instrumentor.py: attach to the optimizer `get_megatron_optimizer` / `setup_model_and_optimizer` build;
- adapters.py: read FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer and
  ChainedOptimizer, and the rank-local gradients at a bucket group's grad sync;
- groups.py: its data-, tensor- and pipeline-parallel groups (`parallel_state`).

Light on import (never imports Megatron, nor the monitor): msmon.optimizers, dedupe.py and
distributed.py ask it what it declares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .groups import groups_of_process, pipeline_position

if TYPE_CHECKING:
    from ...optimizers.base import OptimizerAdapter
    from .. import Session

__all__ = [
    "DISTRIBUTION",
    "OPTIMIZER_CLASSES",
    "OPT_TY",
    "SUPPORTED",
    "adapter_for",
    "groups_of_process",
    "instrument",
    "pipeline_position",
    "uninstrument",
]

DISTRIBUTION = "megatron-core"
SUPPORTED = ">=0.16,<0.17"  # the layout of adapters.py; tested on 0.16.1

# Megatron's optimizer classes drive an inner torch optimizer (`.optimizer`): not wrappers
OPTIMIZER_CLASSES = frozenset({"MegatronOptimizer", "ChainedOptimizer"})

# msprobe's opt_ty names -> the adapters that fit them
OPT_TY: dict[str, tuple[str, ...]] = {
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


def adapter_for(optimizer: Any) -> OptimizerAdapter | None:
    """The adapter of a Megatron optimizer (chosen by class name), None for any other."""
    from .adapters import megatron_adapter

    return megatron_adapter(optimizer)

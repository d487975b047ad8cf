"""One adapter per optimizer family, chosen from the optimizer's class; each yields named fp32
weights, the consumed gradients and Adam moments (Shards where the family splits them)."""

from __future__ import annotations

import logging
from typing import Any

from ..config import ConfigError
from .base import Moments, OptimizerAdapter, OptimizerGone, Shard, class_names, resolve_optimizer
from .deepspeed import ADAPTERS as DEEPSPEED_ADAPTERS
from .megatron import megatron_adapter
from .torch_optim import TorchOptimAdapter

__all__ = [
    "Moments",
    "OptimizerAdapter",
    "OptimizerGone",
    "Shard",
    "TorchOptimAdapter",
    "adapter_for",
    "resolve_optimizer",
    "OPT_TY",
]

logger = logging.getLogger("msmon")

# msprobe's opt_ty names -> the adapters that fit them (opt_ty is optional: the class decides)
OPT_TY: dict[str, tuple[str, ...]] = {
    "Megatron_FP32Optimizer": ("FP32Adapter",),
    "Megatron_Float16OptimizerWithFloat16Params": ("Float16Adapter",),
    "Megatron_DistributedOptimizer": ("DistributedAdapter",),
    "Megatron_ChainedFloat16OptimizerWithFloat16Params": ("Float16Adapter",),
    "Megatron_ChainedDistributedOptimizer": ("DistributedAdapter",),
    "DeepSpeedZeroOptimizer_Stage0": ("BF16Adapter", "FP16UnfusedAdapter", "TorchOptimAdapter"),
    "DeepSpeedZeroOptimizer_Stage1_or_2": ("Zero12Adapter",),
    "DeepSpeedZeroOptimizer_Stage3": ("Zero3Adapter",),
}


def _fsdp_adapter(inner: Any) -> OptimizerAdapter | None:
    from ..hooks.fsdp import adapter_for as fsdp_adapter_for  # FSDP: told by the parameters, not the class

    return fsdp_adapter_for(inner)


def check_opt_ty(opt_ty: str | None) -> None:
    """Reject an opt_ty msprobe would not know, before training starts."""
    if opt_ty is not None and opt_ty not in OPT_TY:
        raise ConfigError(
            f"opt_ty: {opt_ty!r} is not an optimizer type msprobe knows; leave it out (the optimizer "
            f"class decides) or use one of {', '.join(OPT_TY)}"
        )


def adapter_for(optimizer: Any, opt_ty: str | None = None) -> OptimizerAdapter:
    """The adapter for an optimizer, chosen from its class (wrappers are unwrapped first).
    A given msprobe `opt_ty` is checked against what was detected; the class wins."""
    check_opt_ty(opt_ty)
    inner = resolve_optimizer(optimizer)
    adapter = megatron_adapter(inner)
    if adapter is None:
        family = next((DEEPSPEED_ADAPTERS[n] for n in class_names(inner) if n in DEEPSPEED_ADAPTERS), None)
        adapter = family(inner) if family is not None else _fsdp_adapter(inner) or TorchOptimAdapter(inner)
    if opt_ty is not None:
        parts = getattr(adapter, "parts", None) or [adapter]
        detected = {type(part).__name__ for part in parts}
        if not detected & set(OPT_TY[opt_ty]):
            logger.warning(
                "msmon: opt_ty=%r does not match the optimizer, a %s; monitoring it as the %s it is",
                opt_ty,
                type(inner).__name__,
                type(adapter).__name__,
            )
    return adapter

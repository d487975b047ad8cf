"""Which adapter reads an optimizer: one adapter per optimizer family, chosen from the
optimizer's class; each yields named fp32 weights, the consumed gradients and Adam moments
(Shards where the family splits them).

The adapters live with their framework (`hooks/<framework>/adapters.py`); here the frameworks'
specs are asked in the registry's order (seams/registry.py: Megatron, DeepSpeed, FSDP,
then torch.optim, which fits any optimizer), and msprobe's opt_ty names are the union of theirs.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..config import ConfigError
from .adapters import OptimizerAdapter, unwrap_optimizer
from .registry import frameworks

__all__ = ["OPT_TY", "adapter_for", "check_opt_ty", "framework_optimizer_classes", "resolve_optimizer"]

logger = logging.getLogger("msmon")

# msprobe's opt_ty names -> the adapters that fit them (opt_ty is optional: the class decides)
OPT_TY: dict[str, tuple[str, ...]] = {
    name: fits for framework in frameworks() for name, fits in framework.opt_ty.items()
}


@functools.cache
def framework_optimizer_classes() -> frozenset[str]:
    """Class names whose `.optimizer` is an inner torch optimizer they drive, not a wrapper to
    see through: what the frameworks declare."""
    return frozenset(name for framework in frameworks() for name in framework.optimizer_classes)


def resolve_optimizer(optimizer: Any) -> Any:
    """The real optimizer under wrappers (adapters.unwrap_optimizer), the frameworks' own
    optimizer classes being what is monitored, not wrappers."""
    return unwrap_optimizer(optimizer, framework_optimizer_classes())


def check_opt_ty(opt_ty: str | None) -> None:
    """Reject an opt_ty msprobe would not know, before training starts."""
    if opt_ty is not None and opt_ty not in OPT_TY:
        raise ConfigError(
            f"opt_ty: {opt_ty!r} is not an optimizer type msprobe knows; leave it out (the optimizer "
            f"class decides) or use one of {', '.join(OPT_TY)}"
        )


def _family_adapter(inner: Any) -> OptimizerAdapter:
    """The first framework's answer for `inner` (torch_optim, last, always answers)."""
    for framework in frameworks():
        adapter = framework.adapter_for(inner) if framework.adapter_for is not None else None
        if adapter is not None:
            return adapter
    raise TypeError(f"msmon: no adapter for {type(inner).__name__}")  # unreachable: torch_optim answers


def adapter_for(optimizer: Any, opt_ty: str | None = None) -> OptimizerAdapter:
    """The adapter for an optimizer, chosen from its class (wrappers are unwrapped first).
    A given msprobe `opt_ty` is checked against what was detected; the class wins."""
    check_opt_ty(opt_ty)
    inner = resolve_optimizer(optimizer)
    adapter = _family_adapter(inner)
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

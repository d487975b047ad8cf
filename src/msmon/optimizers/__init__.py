"""One adapter per optimizer family; each yields named fp32 params, grads and Adam moments."""
from .base import OptimizerAdapter, resolve_optimizer
from .torch_optim import TorchOptimAdapter

__all__ = ["OptimizerAdapter", "TorchOptimAdapter", "resolve_optimizer", "adapter_for"]


def adapter_for(optimizer, opt_ty: str | None = None) -> OptimizerAdapter:
    """The adapter for an optimizer, chosen from its class (wrappers are unwrapped first)."""
    inner = resolve_optimizer(optimizer)
    return TorchOptimAdapter(inner)

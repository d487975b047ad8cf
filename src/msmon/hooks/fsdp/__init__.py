"""PyTorch FSDP: FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel(use_orig_params=True)`).

Both train a torch.optim optimizer the script builds after sharding, so the torch.optim
instrumentor attaches at its construction with no code change; what this package adds is how
that optimizer is read (`adapter_for`, chosen from its parameters: DTensors, or FSDP1's
flattened originals), the groups pieces are combined across (groups.py) and where the
rank-local gradients are read (seams.py). Nothing is patched until a monitor asks for the
rank-local gradients.
"""

from __future__ import annotations

from typing import Any

from .adapters import Fsdp1Adapter, Fsdp2Adapter, adapter_for

__all__ = ["SUPPORTED", "Fsdp1Adapter", "Fsdp2Adapter", "adapter_for", "instrument", "uninstrument"]

#: the torch versions this was verified with (tests/e2e/test_fsdp_e2e.py)
SUPPORTED = "torch>=2.13,<2.14"


def instrument(session: Any) -> None:
    """Nothing to wrap: the optimizer is a torch.optim one, attached by the torch.optim
    instrumentor, its adapter from `adapter_for`. accelerate's `prepare`, which swaps the
    optimizer's parameters for sharded ones after it was built, has its own instrumentor
    (accelerate_prepare.py, switched on by the import of accelerate)."""


def uninstrument() -> None:
    """Nothing was wrapped (the reduce seam is removed with the last monitor using it)."""

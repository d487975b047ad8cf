"""PyTorch FSDP: FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel`, with
`use_orig_params` True or False): everything msmon knows about it.

Both train a torch.optim optimizer the script builds after sharding, so the torch.optim
instrumentor attaches at its construction with no code change; what this package adds is how
that optimizer is read (adapters.py: `adapter_for`, chosen from its parameters: DTensors, or
FSDP1's flattened originals), the groups pieces are combined across (groups.py), where the
rank-local gradients are read (seams.py: nothing is patched until a monitor asks for them), and
accelerate's `prepare`, which moves an optimizer onto sharded parameters after it was built
(accelerate_prepare.py, switched on when accelerate is imported).

Light on import (never imports FSDP, nor the monitor): it exports its `FRAMEWORK` spec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ...seams.spec import Framework

if TYPE_CHECKING:
    from ...seams.adapters import OptimizerAdapter
    from .. import Session

__all__ = ["FRAMEWORK", "adapter_for", "instrument", "uninstrument"]


def instrument(session: Session) -> None:
    """Nothing of FSDP is wrapped; accelerate's `prepare` is, once accelerate is imported."""
    import wrapt

    def on_accelerate(_module: Any) -> None:
        from . import accelerate_prepare

        accelerate_prepare.instrument(session)

    wrapt.register_post_import_hook(on_accelerate, "accelerate")


def uninstrument() -> None:
    """Put accelerate's `prepare` back (the reduce seam goes with the last monitor using it)."""
    import sys

    if "msmon.hooks.fsdp.accelerate_prepare" in sys.modules:
        from . import accelerate_prepare

        accelerate_prepare.uninstrument()


def adapter_for(optimizer: Any) -> OptimizerAdapter | None:
    """The adapter of an optimizer over FSDP parameters (told by the parameters, not the
    optimizer's class), None for any other."""
    from .adapters import adapter_for as fsdp_adapter_for

    return fsdp_adapter_for(optimizer)


def whole_gradient_reduction(
    models: list[Any], optimizer: Any, before: Callable[[list[Any] | None], None], after: Callable[[], None]
) -> Callable[[], None] | None:
    """FSDP1 NO_SHARD all-reduces the whole flat gradient: `before`/`after` around it (reduction.py)."""
    from .reduction import whole_gradient_reduction as wrap

    return wrap(models, optimizer, before, after)


FRAMEWORK = Framework(
    name="fsdp",
    switched_on_by="torch.distributed.fsdp",
    precedence=30,
    distribution="torch",
    supported=">=2.13,<2.14",  # verified by tests/e2e/test_fsdp_e2e.py (FSDP2's reduce seam is torch-internal)
    instrument=instrument,
    uninstrument=uninstrument,
    adapter_for=adapter_for,
    whole_gradient_reduction=whole_gradient_reduction,
)

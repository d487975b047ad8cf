"""torch's GradScaler classes whose methods msmon's seams wrap (scaler_steps.py: `step`,
grad_rewrites.py: `unscale_`): one list, so that a scaler torch adds is followed by both."""

from __future__ import annotations


def scaler_classes_defining(method: str) -> list[type]:
    """torch's GradScaler and its subclasses (FSDP's ShardedGradScaler) that define `method` themselves."""
    import torch

    classes: list[type] = [torch.amp.GradScaler]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        classes.append(ShardedGradScaler)
    except ImportError:  # a torch built without distributed
        pass
    return [cls for cls in classes if method in vars(cls)]

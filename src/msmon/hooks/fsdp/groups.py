"""Which ranks hold the pieces of an FSDP parameter, and which ranks hold replicas of it.

FSDP2 (`fully_shard`) says it in the parameter itself: a DTensor on a device mesh whose
`Shard` dimension is the group the tensor is split across and whose `Replicate` dimension
(HSDP) the group it is copied across. FSDP1 keeps it in its modules: each
FullyShardedDataParallel unit's `process_group` shards its flat parameter, and under the
hybrid strategies `_inter_node_pg` replicates it. Found once, at attach time.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Placement:
    """The group one parameter is split across, and the group its whole is replicated across (HSDP)."""

    shard: Any
    replicate: Any = None


def is_dtensor(t: Any) -> bool:
    return callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def dtensor_placement(param: Any) -> Placement | None:
    """The shard and replicate groups of an FSDP2 parameter; None when it is not split (all
    placements Replicate: nothing to combine)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = param.device_mesh
    shard = replicate = None
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if shard is not None:
                return None  # split along two mesh dimensions: not an FSDP layout
            shard = mesh.get_group(dim)
        elif isinstance(placement, Replicate):
            replicate = mesh.get_group(dim)
    return Placement(shard, replicate) if shard is not None else None


def is_flat_param(t: Any) -> bool:
    return type(t).__name__ == "FlatParameter" or (
        hasattr(t, "_numels_with_padding") and hasattr(t, "_shard_param_infos")
    )


def fsdp1_units() -> list[Any]:
    """The live FullyShardedDataParallel units that hold a flat parameter (searched once)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return []
    # type(), not isinstance(): isinstance asks a dead weak proxy for __class__ and raises
    units = [o for o in gc.get_objects() if issubclass(type(o), FullyShardedDataParallel)]
    return [u for u in units if getattr(u, "_handle", None) is not None]


def unit_placement(unit: Any) -> Placement:
    """The shard group of an FSDP1 unit, and its replicate group under HYBRID_SHARD."""
    return Placement(unit.process_group, getattr(unit, "_inter_node_pg", None))

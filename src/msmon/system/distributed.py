"""Rank and world facts, read once, never with a collective on the hot path. The pipeline stage,
which the framework packages know, is seams/pipeline.py's.

Torch-free until torch is loaded: torch.distributed cannot be initialised in a process that never
imported it, so the rank is read without importing torch (the framework registry logs with it)."""

from __future__ import annotations

import os
import sys
from typing import Any


def is_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def several_processes() -> bool:
    """Whether torch.distributed runs with more than one process (asked in gradient hooks: no
    call of is_initialized)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# where launchers put a process's rank before torch.distributed starts: torch's launchers
# (torchrun, accelerate, deepspeed) set RANK; srun sets SLURM_PROCID, which a script reads itself
RANK_VARIABLES = ("RANK", "SLURM_PROCID")
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")


def current_rank() -> int:
    """Global rank: torch.distributed when initialised, else the launcher's RANK (SLURM_PROCID
    under srun), else 0."""
    if is_initialized():
        return sys.modules["torch.distributed"].get_rank()
    return environment_rank(RANK_VARIABLES)


def environment_rank(names: tuple[str, ...] = RANK_VARIABLES) -> int:
    """The first of the variables `names` that is set (RANK_VARIABLES, LOCAL_RANK_VARIABLES), else 0."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return int(value)
    return 0


def position_in(group: Any) -> tuple[int, list[int]] | None:
    """This rank's place in `group` (or in the first group of a list that holds it)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for candidate in group if isinstance(group, (list, tuple)) else [group]:
        if candidate is None:
            continue
        ranks = dist.get_process_group_ranks(candidate)
        if rank in ranks:
            return ranks.index(rank), list(ranks)
    return None

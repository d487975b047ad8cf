"""Rank, world and pipeline-stage facts, read once, never with a collective on the hot path."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


# where launchers put a process's rank before torch.distributed starts: torch's launchers
# (torchrun, accelerate, deepspeed) set RANK; srun sets SLURM_PROCID, which a script reads itself
RANK_VARIABLES = ("RANK", "SLURM_PROCID")
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")


def current_rank() -> int:
    """Global rank: torch.distributed when initialised, else the launcher's RANK (SLURM_PROCID
    under srun), else 0."""
    if is_initialized():
        return dist.get_rank()
    return environment_rank(RANK_VARIABLES)


def environment_rank(names: tuple[str, ...] = RANK_VARIABLES) -> int:
    """The first of the variables `names` that is set (RANK_VARIABLES, LOCAL_RANK_VARIABLES), else 0."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return int(value)
    return 0


def pipeline_position(process_group: Any = None) -> tuple[int, list[int]]:
    """(pp_stage, group_mates) of this rank: its rank within the pipeline group and the global
    ranks of that group.

    The pipeline group is, in order: the process group given to TrainerMon (msprobe's
    `process_group`), else the first framework package that knows one (`pipeline_position()` of
    hooks/<framework>/groups.py, in the registry's order: Megatron-core's parallel state,
    DeepSpeed's pipeline grid); else stage 0 alone. Never the global rank
    (msprobe's fallback, which made every rank of a data-parallel job a different "stage").
    Frameworks are only consulted when the job imported them; no collective is issued.
    """
    rank = current_rank()
    if not is_initialized():
        return 0, [rank]
    from ..hooks import frameworks

    sources: list[Callable[[], tuple[int, list[int]] | None]] = [lambda: _given_group(process_group)]
    sources += [package.pipeline_position for package in frameworks() if hasattr(package, "pipeline_position")]
    for source in sources:
        try:
            found = source()
        except Exception:  # a framework in an unexpected state: try the next source
            found = None
        if found is not None:
            return found
    return 0, [rank]


def position_in(group: Any) -> tuple[int, list[int]] | None:
    """This rank's place in `group` (or in the first group of a list that holds it)."""
    rank = dist.get_rank()
    for candidate in group if isinstance(group, (list, tuple)) else [group]:
        if candidate is None:
            continue
        ranks = dist.get_process_group_ranks(candidate)
        if rank in ranks:
            return ranks.index(rank), list(ranks)
    return None


def _given_group(process_group: Any) -> tuple[int, list[int]] | None:
    return position_in(process_group) if process_group is not None else None

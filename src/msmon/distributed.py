"""Rank, world and pipeline-stage facts, read once, never with a collective on the hot path."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def current_rank() -> int:
    """Global rank: torch.distributed when initialised, else torchrun's RANK, else 0."""
    if is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def world_size() -> int:
    if is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def pipeline_position(process_group: Any = None) -> tuple[int, list[int]]:
    """(pp_stage, group_mates) of this rank: its rank within the pipeline group and the global
    ranks of that group.

    The pipeline group is, in order: the process group given to TrainerMon (msprobe's
    `process_group`), Megatron-core's pipeline group when its parallel state is initialised,
    DeepSpeed's pipeline grid (`deepspeed.utils.groups.mpu`, set by the pipeline engine or a
    Megatron mpu handed to deepspeed.initialize); else stage 0 alone. Never the global rank
    (msprobe's fallback, which made every rank of a data-parallel job a different "stage").
    Frameworks are only consulted when the job imported them; no collective is issued.
    """
    rank = current_rank()
    if not is_initialized():
        return 0, [rank]
    for source in (_given_group, _megatron_group, _deepspeed_group):
        try:
            found = source(process_group)
        except Exception:  # a framework in an unexpected state: try the next source
            found = None
        if found is not None:
            return found
    return 0, [rank]


def _position_in(group: Any) -> tuple[int, list[int]] | None:
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
    return _position_in(process_group) if process_group is not None else None


def _megatron_group(_: Any) -> tuple[int, list[int]] | None:
    if "megatron.core" not in sys.modules:
        return None
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    found = _position_in(mpu.get_pipeline_model_parallel_group())
    if found is None:
        return None
    return mpu.get_pipeline_model_parallel_rank(), found[1]


def _deepspeed_group(_: Any) -> tuple[int, list[int]] | None:
    groups = sys.modules.get("deepspeed.utils.groups")
    grid = getattr(groups, "mpu", None) if groups is not None else None
    if grid is None:
        return None
    if hasattr(grid, "get_pipe_parallel_group"):  # DeepSpeed's PipelineParallelGrid
        found = _position_in(grid.get_pipe_parallel_group())
        stage = grid.get_pipe_parallel_rank() if hasattr(grid, "get_pipe_parallel_rank") else None
    elif hasattr(grid, "get_pipeline_model_parallel_group"):  # a Megatron mpu given to DeepSpeed
        found = _position_in(grid.get_pipeline_model_parallel_group())
        stage = grid.get_pipeline_model_parallel_rank()
    else:
        return None
    if found is None:
        return None
    return (found[0] if stage is None else stage), found[1]

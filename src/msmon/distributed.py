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
    """(pp_stage, group_mates): from the given group, Megatron, DeepSpeed, else (0, [rank])."""
    rank = current_rank()
    if not is_initialized():
        return 0, [rank]
    if process_group is not None:
        try:
            return dist.get_group_rank(process_group, rank), dist.get_process_group_ranks(process_group)
        except Exception:
            pass
    try:  # Megatron-core, when the job uses it (never imported by us) and it is initialised
        if "megatron.core" not in sys.modules:
            raise ImportError
        from megatron.core import parallel_state as mpu  # type: ignore

        if mpu.model_parallel_is_initialized():
            group = mpu.get_pipeline_model_parallel_group()
            return mpu.get_pipeline_model_parallel_rank(), dist.get_process_group_ranks(group)
    except Exception:
        pass
    try:  # DeepSpeed pipeline engine groups, when the job uses DeepSpeed
        if "deepspeed" not in sys.modules:
            raise ImportError
        from deepspeed.utils import groups  # type: ignore

        grid = getattr(groups, "_grid", None) or getattr(groups, "mpu", None)
        if grid is not None and hasattr(grid, "get_pipe_parallel_rank"):
            return grid.get_pipe_parallel_rank(), dist.get_process_group_ranks(grid.get_pipe_parallel_group())
    except Exception:
        pass
    return 0, [rank]

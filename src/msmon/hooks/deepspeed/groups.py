"""DeepSpeed's parallel groups, as msmon's write-once rule (dedupe.py) and pipeline stages
(seams/pipeline.py) need them, read from what DeepSpeed already set up (never a collective):
- a DeepSpeedEngine (or PipelineEngine) handed over as the model: its (sequence-)data-parallel
  group and, through the mpu it was given, the tensor-parallel group. Its stage-0 path
  all-reduces `param.grad.data`, which the adapter is told (`reduced_through_data`);
- DeepSpeed's pipeline grid (`deepspeed.utils.groups.mpu`, set by the pipeline engine or a
  Megatron mpu handed to deepspeed.initialize).
"""

from __future__ import annotations

import sys
from typing import Any

from ...seams.parallel_groups import ParallelGroups, call_quietly
from ...system.distributed import position_in

ENGINES = ("DeepSpeedEngine", "PipelineEngine")


def groups_of_models(found: ParallelGroups, models: list[Any], adapter: Any) -> None:
    """Fill what `found` lacks from a DeepSpeed engine among `models`."""
    engine = next((m for m in models if type(m).__name__ in ENGINES), None)
    if engine is None:
        return
    if adapter is not None:
        adapter.reduced_through_data = True  # the stage-0 engine all-reduces `param.grad.data`
    if found.dp is None:
        found.dp = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
        found.source = "the DeepSpeed engine"
    mpu = getattr(engine, "mpu", None)
    if found.tp is None and mpu is not None:
        getter = getattr(mpu, "get_tensor_model_parallel_group", None) or getattr(mpu, "get_model_parallel_group", None)
        found.tp = call_quietly(getter)


def pipeline_position() -> tuple[int, list[int]] | None:
    """(stage, ranks of the pipeline group) from DeepSpeed's pipeline grid, when it has one."""
    groups = sys.modules.get("deepspeed.utils.groups")
    grid = getattr(groups, "mpu", None) if groups is not None else None
    if grid is None:
        return None
    if hasattr(grid, "get_pipe_parallel_group"):  # DeepSpeed's PipelineParallelGrid
        found = position_in(grid.get_pipe_parallel_group())
        stage = grid.get_pipe_parallel_rank() if hasattr(grid, "get_pipe_parallel_rank") else None
    elif hasattr(grid, "get_pipeline_model_parallel_group"):  # a Megatron mpu given to DeepSpeed
        found = position_in(grid.get_pipeline_model_parallel_group())
        stage = grid.get_pipeline_model_parallel_rank()
    else:
        return None
    if found is None:
        return None
    return (found[0] if stage is None else stage), found[1]

"""Megatron-core's parallel groups, as msmon's write-once rule (dedupe.py) and pipeline stages
(seams/pipeline.py) need them: read from `megatron.core.parallel_state` when the job imported and
initialised it (msmon never imports Megatron), never with a collective.
"""

from __future__ import annotations

import sys
from typing import Any

from ...seams.library import library
from ...seams.parallel_groups import ParallelGroups, call_quietly
from ...system.distributed import position_in


def parallel_state() -> Any:
    """Megatron-core's parallel_state when the job uses it and it is set up, else None."""
    if "megatron.core" not in sys.modules:
        return None
    try:
        state = library("megatron.core.parallel_state")
        return state if state.model_parallel_is_initialized() else None
    except Exception:
        return None


def groups_of_process(found: ParallelGroups) -> None:
    """Fill what `found` lacks from parallel_state: data-parallel with context parallel, tensor-
    and pipeline-parallel."""
    state = parallel_state()
    if state is None:
        return
    if found.dp is None:
        found.dp = call_quietly(state.get_data_parallel_group, with_context_parallel=True)
        found.source = "Megatron parallel_state"
    if found.tp is None:
        found.tp = call_quietly(state.get_tensor_model_parallel_group)
    found.pp = call_quietly(state.get_pipeline_model_parallel_group)


def pipeline_position() -> tuple[int, list[int]] | None:
    """(stage, ranks of the pipeline group) from parallel_state, when it is initialised."""
    if "megatron.core" not in sys.modules:
        return None
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    found = position_in(mpu.get_pipeline_model_parallel_group())
    if found is None:
        return None
    return mpu.get_pipeline_model_parallel_rank(), found[1]

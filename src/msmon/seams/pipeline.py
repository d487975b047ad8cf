"""This rank's pipeline stage: asked of the process group given to TrainerMon, else of the
frameworks in the registry's order (their specs' `pipeline_position`), never with a collective.
Here rather than in system/distributed.py, which stays below the framework registry."""

from __future__ import annotations

from typing import Any, Callable

from ..system.distributed import current_rank, is_initialized, position_in
from .registry import frameworks


def pipeline_position(process_group: Any = None) -> tuple[int, list[int]]:
    """(pp_stage, group_mates) of this rank: its rank within the pipeline group and the global
    ranks of that group.

    The pipeline group is, in order: the process group given to TrainerMon (msprobe's
    `process_group`), else the first framework that knows one (its spec's `pipeline_position`,
    in the registry's order: Megatron-core's parallel state,
    DeepSpeed's pipeline grid); else stage 0 alone. Never the global rank
    (msprobe's fallback, which made every rank of a data-parallel job a different "stage").
    Frameworks are only consulted when the job imported them; no collective is issued.
    """
    rank = current_rank()
    if not is_initialized():
        return 0, [rank]
    sources: list[Callable[[], tuple[int, list[int]] | None]] = [lambda: _given_group(process_group)]
    sources += [framework.pipeline_position for framework in frameworks() if framework.pipeline_position is not None]
    for source in sources:
        try:
            found = source()
        except Exception:  # a framework in an unexpected state: try the next source
            found = None
        if found is not None:
            return found
    return 0, [rank]


def _given_group(process_group: Any) -> tuple[int, list[int]] | None:
    return position_in(process_group) if process_group is not None else None

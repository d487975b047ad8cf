"""The data-, tensor- and pipeline-parallel groups of one monitor, as the framework packages fill
them (`Framework.groups_of_models`, `groups_of_process`) and runtime/dedupe.py reads them to decide
who writes a replicated tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ParallelGroups:
    """The process groups found for one monitor, with where each came from."""

    dp: Any = None
    tp: Any = None
    pp: Any = None
    source: str = "none"

    def describe(self) -> str:
        sizes = ", ".join(
            f"{name}={_size(group)}"
            for name, group in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp))
            if group is not None
        )
        return f"{sizes or 'no parallel groups'} (from {self.source})"

    def sizes(self) -> dict[str, Any]:
        """{"dp": 2, "tp": 1, ..., "from": where they came from}: the groups found, for summary.json."""
        found: dict[str, Any] = {
            name: _size(group)
            for name, group in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp))
            if group is not None
        }
        return {**found, "from": self.source}


def _size(group: Any) -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size(group)
    except Exception:
        return 1


def call_quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), else fn(*args) (an older signature), else None: a framework's group
    getter asked before its state is set up."""
    if fn is None:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception:  # not initialised, or an older signature
        try:
            return fn(*args)
        except Exception:
            return None

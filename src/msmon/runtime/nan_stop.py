"""`alert.on_nan: "stop"`: end the job, on every rank at the same step, after a step whose
statistics hold a NaN or an inf.

Why here and how. The NaN is seen per rank, on the host, once the step's one copy has arrived.
Stopping one rank alone would leave the others waiting in the training's next collective, so
each monitored rank, at the end of every optimizer step, gives one number (1: this step's
statistics or finiteness flags hold a non-finite value; 0: not) to one all_gather on msmon's own
gloo group, and every rank stops when any number is 1. Every rank reads the same numbers after
the same step, so all stop after that step, or none does. The stop closes the monitor first
(every pending step written, the anomaly dump with this step's alerts, summary.json), then
raises `StopOnNan` (a SystemExit with a non-zero code).

What it costs, and only when asked for: the training thread waits at the end of each recorded
step for that step's statistics to reach the host (on a GPU: for the step's kernels to finish),
and each step takes one small gloo all_gather. The mode is fixed when the monitor attaches: a
config edit that changed it would reach the ranks at different steps, and one rank would wait
in the gather alone.
"""

from __future__ import annotations

import inspect
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..system import exit_drain
from ..system.distributed import several_processes

if TYPE_CHECKING:
    from .transfer import HostBatch

logger = logging.getLogger("msmon")

GATHER_TIMEOUT = timedelta(minutes=10)


def has_nonfinite(batch: HostBatch | None) -> bool:
    """Whether a step's statistics (or its finiteness flags) hold a NaN or an inf; waits for the
    step's copy to reach the host."""
    if batch is None:
        return False
    batch.wait()
    if batch.values.numel() and not bool(torch.isfinite(batch.values).all()):  # a host tensor
        return True
    return not all(batch.finite_flags())


class NanStop:
    """The monitored ranks' agreement, step by step, on whether to stop (module docstring)."""

    def __init__(self, ranks: list[int] | None) -> None:
        self.ranks = ranks  # the monitored ranks (module_ranks), None: every rank
        self._group: Any = None
        self._size = 1

    def ranks_with_nonfinite(self, batch: HostBatch | None) -> list[int]:
        """The monitored ranks whose step just ended held a non-finite statistic, the same list on
        every one of them. Called by every monitored rank after every optimizer step."""
        mine = has_nonfinite(batch)
        if not several_processes():
            return [0] if mine else []
        members, values = self._gather(1.0 if mine else 0.0)
        return [rank for rank, value in zip(members, values) if value > 0]

    def all_closed(self) -> None:
        """Wait until every monitored rank has closed its monitor: a launcher (torchrun) ends the
        other ranks as soon as one exits, which must not cut a rank's last writes short."""
        if several_processes():
            self._gather(0.0)

    def _gather(self, value: float) -> tuple[list[int], list[float]]:
        group, members = self._members()
        if len(members) == 1:
            return members, [value]
        mine = torch.tensor([value])
        gathered = [torch.empty_like(mine) for _ in members]
        all_gather = getattr(dist.all_gather, "__msmon_original__", dist.all_gather)  # not the training's comm
        exit_drain.hold(all_gather(gathered, mine, group=group, async_op=True)).wait()
        return members, [float(v[0]) for v in gathered]

    def _members(self) -> tuple[Any, list[int]]:
        """msmon's own gloo group over the monitored ranks, made at the first step (every
        monitored rank gets there), so the gather never queues behind the training's collectives."""
        members = sorted(self.ranks) if self.ranks else list(range(dist.get_world_size()))
        if self._group is None and len(members) > 1:
            options: dict[str, Any] = {"backend": "gloo", "timeout": GATHER_TIMEOUT, "use_local_synchronization": True}
            if "group_desc" in inspect.signature(dist.new_group).parameters:  # torch >= 2.3
                options["group_desc"] = "msmon_nan_stop"
            self._group = dist.new_group(members, **options)
            exit_drain.at_drain(self._release)
        return self._group, members

    def _release(self) -> None:
        if self._group is not None:
            exit_drain.destroy_group(self._group)
            self._group = None

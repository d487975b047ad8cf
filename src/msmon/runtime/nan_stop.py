"""`alert.on_nan: "stop"`: end the job, on every rank at the same step, after a step whose
statistics show a tensor holding a NaN or an inf.

Why here and how. The NaN is seen per rank, on the host, once the step's one copy has arrived.
Stopping one rank alone would leave the others waiting in the training's next collective, so
each monitored rank, at the end of every optimizer step, gives one number (1: this step's rows
or finiteness flags show a non-finite tensor; 0: not) to one all_gather on msmon's own gloo
group, and every rank stops when any number is 1. Every rank reads the same numbers after the
same step, so all stop after that step, or none does. The stop closes the monitor first (every
pending step written, the anomaly dump with this step's alerts, summary.json), then raises
`StopOnNan` (a SystemExit with a non-zero code).

Only tensors count (`has_nonfinite`): a derived value that is undefined (the gradient
agreement's cos of a rank whose local gradient is exactly zero, 0/0: records.DERIVED_CATEGORIES)
and a norm that overflowed on a tensor whose min and max prove it finite (stats/finiteness.py)
never stop a job that trains on finite data.

Uneven inputs. Under DDP's `join()` a rank that ran out of inputs waits in the join context
while the others train on; it takes no more steps, so it would give no number, and the others
would wait in the gather. From the moment it waits there (seams/join_calls.py) a thread of that
rank gives LEFT in each round, until a round in which every rank is LEFT (all have left their
loops; the rank's training thread waits for that round before it goes on, so the next step's
round is the next one on every rank). A round with a 1 still stops the ranks that train; the
thread answers their closing round, then ends.

What it costs, and only when asked for: the training thread waits at the end of each recorded
step for that step's statistics to reach the host (on a GPU: for the step's kernels to finish),
and each step takes one small gloo all_gather. The mode is fixed when the monitor attaches: a
config edit that changed it would reach the ranks at different steps, and one rank would wait
in the gather alone.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..records.rows import DERIVED_CATEGORIES, RowKey
from ..seams import join_calls
from ..seams.listeners import Listening
from ..stats.finiteness import row_is_finite
from ..system import exit_drain
from ..system.distributed import several_processes

if TYPE_CHECKING:
    from .transfer import HostBatch

logger = logging.getLogger("msmon")

GATHER_TIMEOUT = timedelta(minutes=10)


def has_nonfinite(batch: HostBatch | None, ops: Sequence[str]) -> bool:
    """Whether a step's rows (of `ops`) or its finiteness flags show a tensor holding a NaN or an
    inf; waits for the step's copy to reach the host. Only values of tensors count: a derived
    value that is undefined (the agreement's cos of a zero gradient: 0/0) is not a non-finite
    tensor, and neither is a norm or mean that overflowed on a tensor its min and max prove
    finite (a GradScaler's scaled gradient)."""
    if batch is None:
        return False
    batch.wait()
    values = batch.values  # a host tensor
    if values.numel():
        suspect = (~torch.isfinite(values).all(1)).nonzero().view(-1).tolist()
        if suspect and any(_tensor_nonfinite(batch.keys[i], ops, values[i]) for i in suspect):
            return True
    return not all(batch.finite_flags())


def _tensor_nonfinite(key: RowKey, ops: Sequence[str], row: torch.Tensor) -> bool:
    """Whether a row holding a non-finite value shows a non-finite tensor."""
    if key.category in DERIVED_CATEGORIES:
        return False
    if key.op is not None:  # one value of its own column: the loss itself
        return True
    finite = row_is_finite(ops, row.tolist())
    return finite is not True  # ops that cannot tell (a norm alone): a non-finite value counts


FINITE, NONFINITE, LEFT = 0.0, 1.0, 2.0  # a rank's number in a round


class NanStop:
    """The monitored ranks' agreement, step by step, on whether to stop (module docstring)."""

    def __init__(self, ranks: list[int] | None) -> None:
        self.ranks = ranks  # the monitored ranks (module_ranks), None: every rank
        self._group: Any = None
        self._lock = threading.Lock()  # one gather issued at a time, in order (the away thread's and the step's)
        self._away: threading.Thread | None = None  # answers the rounds while the rank waits in a join context
        self._back = False  # the rank came back from the join context: the away thread issues no more
        self._joins: Listening | None = None

    def ranks_with_nonfinite(self, batch: HostBatch | None, ops: Sequence[str]) -> list[int]:
        """The monitored ranks whose step just ended held a non-finite tensor, the same list on
        every one of them. Called by every monitored rank after every optimizer step."""
        mine = has_nonfinite(batch, ops)
        if not several_processes():
            return [0] if mine else []
        members, values = self._gather(NONFINITE if mine else FINITE)
        return [rank for rank, value in zip(members, values) if value == NONFINITE]

    def all_closed(self) -> None:
        """Wait until every monitored rank has closed its monitor: a launcher (torchrun) ends the
        other ranks as soon as one exits, which must not cut a rank's last writes short."""
        if several_processes():
            self._gather(FINITE)

    def follow_joins(self) -> None:
        """Follow join contexts from now on (the monitor is hooked to its optimizer)."""
        if self._joins is None:
            self._joins = join_calls.listen(self._leaving, self._came_back)

    def stop_listening(self) -> None:
        """The monitor is detached: join contexts are not followed any more."""
        if self._joins is not None:
            self._joins.stop()
            self._joins = None

    # -- a rank waiting in a join context -------------------------------------------------------
    def _leaving(self) -> None:
        """This rank ran out of inputs and waits in a join context: until every rank has, its
        number in each round is LEFT, given by a thread (module docstring)."""
        try:
            if not several_processes() or self._away is not None:
                return
            _, members = self._members()  # on the training thread: the group exists before the thread gathers
            if len(members) == 1:
                return
            self._back = False
            self._away = threading.Thread(target=self._answer_while_away, name="msmon-nan-stop-join", daemon=True)
            self._away.start()
        except Exception as exc:  # the join context goes on whatever happens here
            logger.warning("msmon: following a join context for alert.on_nan failed: %r", exc)

    def _came_back(self, every_rank_left: bool) -> None:
        """The join context returned. When every rank left, the away thread ends with the round
        in which all of them were LEFT; wait for it, so that the next step's round is the next
        one. When it raised (throw_on_early_termination), the thread issues no more rounds."""
        away = self._away
        if away is None:
            return
        if every_rank_left:
            away.join()
        else:
            with self._lock:
                self._back = True
        self._away = None

    def _answer_while_away(self) -> None:
        stopping = False
        try:
            while True:
                with self._lock:
                    if self._back:
                        return
                    members, gathered, work = self._issue(LEFT)
                work.wait()
                values = [float(v[0]) for v in gathered]
                if all(v == LEFT for v in values) or stopping:
                    return
                # the ranks still training stop after this round; their all_closed is the next one
                stopping = any(v == NONFINITE for v in values)
        except Exception as exc:  # a rank that stopped and is gone: nothing left to answer
            logger.debug("msmon: the nan-stop rounds of a rank in a join context ended: %r", exc)

    # -- the gathers ----------------------------------------------------------------------------
    def _gather(self, value: float) -> tuple[list[int], list[float]]:
        with self._lock:
            members, gathered, work = self._issue(value)
        if work is not None:
            work.wait()
        return members, [float(v[0]) for v in gathered]

    def _issue(self, value: float) -> tuple[list[int], list[torch.Tensor], Any]:
        """Start one round's all_gather on msmon's group: (members, their numbers once done, the work)."""
        group, members = self._members()
        mine = torch.tensor([value])
        if len(members) == 1:
            return members, [mine], None
        gathered = [torch.empty_like(mine) for _ in members]
        all_gather = getattr(dist.all_gather, "__msmon_original__", dist.all_gather)  # not the training's comm
        return members, gathered, exit_drain.hold(all_gather(gathered, mine, group=group, async_op=True))

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

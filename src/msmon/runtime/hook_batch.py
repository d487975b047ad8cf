"""Tensors noted in hooks on an accelerator, read together in one batch at the next batch point.

On an accelerator every statistic op is a kernel launch plus Python dispatch (10-20 µs of host
time each), and reading each hooked activation tensor on its own costs several of them per
tensor. So on the device path (a non-CPU device, or MSMON_DEVICE_PATH=1) a hook only *notes*
the tensor: a reference, its data pointer and its version counter, and a `PendingRow` that
takes the tensor's place in the step buffer (in hook order, so rows keep their call_id). All
noted tensors are read in one `batch_stats` call at the next batch point: the end of the
monitored model's forward, the end of the backward pass (an autograd final callback, queued at
the first note of that pass), before an in-place module overwrites its input, when the notes
hold more than `budget_bytes`, before a collective writes into a noted tensor (a collective moves
no version counter: msmon.runtime.collective_flush), and at the latest before the step's rows
are taken.

The price is memory: a noted forward activation that autograd would have freed stays alive until
the batch point, at most `budget_bytes` of them (MSMON_HOOK_BATCH_BYTES, 256 MiB by default). A
tensor modified in place between its hook and the batch point (same object, new version or
storage) would be misreported: its row is left out instead (`PendingRow.lost`; the buffer drops
the key), and the owner is told (`on_lost`) so that it reads that key in the hook from then on.
On the CPU's own path (the native kernel, CPU shortcuts) nothing is noted: hooks read at once,
which measured as fast there.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from ..stats.device_path import host_code
from ..stats.engine import batch_stats
from .step_collector import StepCollector as Collector
from .tensor_memo import TensorMemo

if TYPE_CHECKING:
    from ..config import MonitorConfig

BUDGET_ENV = "MSMON_HOOK_BATCH_BYTES"
DEFAULT_BUDGET = 256 << 20

LostCallback = Callable[[Any], None]


def budget_from_environment() -> int:
    """Bytes of noted tensors kept alive before an early batch (MSMON_HOOK_BATCH_BYTES)."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    return int(text) if text.isdigit() else DEFAULT_BUDGET


def batches(device: torch.device) -> bool:
    """Whether tensors on `device` are noted and read in batches (the accelerator path)."""
    return not host_code(device)


class PendingRow:
    """A tensor's statistics row before its batch is read: `row` once read, `lost` when the
    tensor changed before that and no row may be given."""

    __slots__ = ("row", "lost")

    def __init__(self) -> None:
        self.row: torch.Tensor | None = None
        self.lost = False


def resolved(row: torch.Tensor | PendingRow) -> torch.Tensor | None:
    """The row itself, or None when it was lost."""
    if isinstance(row, PendingRow):
        assert row.row is not None or row.lost, "a pending row is read before its batch point"
        return row.row
    return row


class _Note:
    __slots__ = ("tensor", "data_ptr", "version", "pending", "owner", "on_lost", "tag")

    def __init__(
        self, tensor: torch.Tensor, pending: PendingRow, owner: Collector, on_lost: LostCallback, tag: Any
    ) -> None:
        self.tensor = tensor
        self.data_ptr = tensor.data_ptr()
        self.version = tensor._version
        self.pending = pending
        self.owner = owner
        self.on_lost = on_lost
        self.tag = tag

    def unchanged(self) -> bool:
        t = self.tensor
        return t._version == self.version and t.data_ptr() == self.data_ptr


class BatchOwner(Protocol):
    """What a batch needs of the step context (step_context.py's StepContext, which holds it)."""

    step_ops: list[str]
    config: MonitorConfig
    rows_read: TensorMemo[torch.Tensor | PendingRow]

    def report_failure(self, collector: Collector, exc: BaseException) -> None: ...


class HookBatch:
    """The tensors noted since the last batch point (one per monitor: `StepContext.hook_batch`)."""

    __slots__ = ("_ctx", "noted", "_bytes", "budget_bytes", "_task", "batches_read", "track_storage", "_storages")

    def __init__(self, ctx: BatchOwner, budget_bytes: int | None = None) -> None:
        self._ctx = ctx
        self.noted: list[_Note] = []  # since the last batch point (none on the CPU's own path)
        self._bytes = 0
        self.budget_bytes = budget_from_environment() if budget_bytes is None else budget_bytes
        self._task: int | None = None  # the backward pass whose end reads the notes
        self.batches_read = 0  # batch_stats calls made (a benchmark's and a test's count)
        # under collectives (msmon.runtime.collective_flush): storage -> the tensors noted on it this step
        self.track_storage = False
        self._storages: dict[int, list[weakref.ref[torch.Tensor]]] = {}  # weak: the step keeps nothing alive

    def __len__(self) -> int:
        return len(self.noted)

    def note(self, t: torch.Tensor, owner: Collector, on_lost: LostCallback, tag: Any) -> PendingRow:
        """Note `t` (detached: the note never joins the graph) for the next batch; its row
        comes in the returned PendingRow. `on_lost(tag)` is called if `t` changes before then."""
        pending = PendingRow()
        self.noted.append(_Note(t.detach(), pending, owner, on_lost, tag))
        if self.track_storage:
            self._storages.setdefault(t.untyped_storage().data_ptr(), []).append(weakref.ref(t))
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._task:  # first note of this backward pass: read at its end
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self._bytes += t.numel() * t.element_size()
        if self._bytes > self.budget_bytes:
            self.flush()
        return pending

    def flush(self) -> None:
        """Read every noted tensor that is unchanged, in one batch; mark the others lost."""
        notes, self.noted, self._bytes, self._task = self.noted, [], 0, None
        if not notes:
            return
        ctx = self._ctx
        kept = [n for n in notes if n.unchanged()]
        try:
            if kept:
                rows = batch_stats([n.tensor for n in kept], ctx.step_ops, ctx.config.eps)
                self.batches_read += 1
                for j, n in enumerate(kept):
                    n.pending.row = rows[j]
        except Exception as exc:  # contained: the owners stop, training goes on
            for n in kept:
                n.pending.lost = True
            for owner in {id(n.owner): n.owner for n in kept}.values():
                ctx.report_failure(owner, exc)
        for n in notes:
            if n.pending.row is None and not n.pending.lost:
                n.pending.lost = True
                try:
                    n.on_lost(n.tag)
                except Exception as exc:
                    ctx.report_failure(n.owner, exc)

    def before_collective(self, tensors: list[torch.Tensor]) -> None:
        """A collective is about to write into `tensors` without moving their version counters
        (msmon.runtime.collective_flush): read the batch first if it holds one of them, and forget
        the rows of every tensor noted on their storage this step, so that a hook meeting the same
        tensor again reads its new value instead of reusing the old row."""
        if not self._storages or not tensors:
            return
        hit = [self._storages.pop(t.untyped_storage().data_ptr(), None) for t in tensors]
        written = [noted for noted in hit if noted]
        if not written:
            return
        if self.noted:
            self.flush()
        rows_read = self._ctx.rows_read
        for noted in written:
            for ref in noted:
                t = ref()
                if t is not None:
                    rows_read.forget(t)

    def tracks_any(self) -> bool:
        return bool(self._storages)

    def end_step(self) -> None:
        self._storages.clear()

    def clear(self) -> None:
        """Forget the notes without reading them (a step that is not recorded)."""
        for n in self.noted:
            n.pending.lost = True
        self.noted, self._bytes, self._task = [], 0, None
        self._storages.clear()

"""The per-step buffer that keeps a step's rows on the device until one copy at its end.

A row is one tensor's statistics; its key says which tensor (msmon.records.rows.RowKey). Rows
are appended in execution order, so a row's index within its step is its call_id. A row may
be pending (msmon.runtime.hook_batch: its tensor was noted in a hook and is read with others at
the next batch point): it holds its place, and a pending row that was lost (its tensor changed
before the batch point) is left out with its key when the rows are taken.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import cast

import torch

from ..records.rows import RowKey
from .hook_batch import PendingRow, resolved
from .row_finiteness import RowFiniteness

Row = torch.Tensor | PendingRow
_present = functools.partial(operator.is_not, None)  # a row that was not lost


@dataclass
class Histogram:
    """A histogram computed on the device: counts over fixed bucket edges."""

    tag: str
    edges: list[float]
    counts: torch.Tensor


class RowGroup:
    """The rows of one key that a module called several times in a micro-step produces (a cell
    run in a Python loop): one row per call while the step runs, combined into the row of all
    calls together (msmon.stats.combine_rows: norms in squares, min of mins, ...) when the
    step's rows are taken. A group of one row is that row. One object per key and step: the
    first row is held in place, lists only for a module that is called again. A group with a
    lost row is left out whole: a combination of some of the calls would be misreported."""

    __slots__ = ("ops", "first", "first_numel", "more")

    def __init__(self, ops: list[str]) -> None:
        self.ops = ops
        self.first: Row | None = None
        self.first_numel = 0
        self.more: list[tuple[Row, int]] | None = None

    def add(self, row: Row, numel: int) -> None:
        if self.first is None:
            self.first, self.first_numel = row, numel
        elif self.more is None:
            self.more = [(row, numel)]
        else:
            self.more.append((row, numel))

    def combined(self) -> torch.Tensor | None:
        """The row of all calls together; None when one of them was lost."""
        first = self.first
        assert first is not None, "an empty RowGroup has no row"
        if self.more is None:
            return resolved(first) if isinstance(first, PendingRow) else first  # no call for a plain row
        from ..stats.combine import combine_rows  # records is imported by stats' users; keep it light

        maybe = [resolved(first)] + [resolved(row) for row, _ in self.more]
        rows = [row for row in maybe if row is not None]
        if len(rows) < len(maybe):
            return None
        numels = [self.first_numel] + [numel for _, numel in self.more]
        stacked = torch.stack([r.to(rows[0].device) for r in rows])
        return combine_rows(stacked, torch.tensor(numels, dtype=stacked.dtype), self.ops)


class StepBuffer:
    """Collects rows on the device during a step; one concatenation and copy at its end."""

    def __init__(self) -> None:
        self.keys: list[RowKey] = []
        self._chunks: list[torch.Tensor | list[Row | RowGroup]] = []
        self._single: list[Row | RowGroup] = []  # rows added one by one since the last chunk
        self._sizes: list[int] = []  # the keys of each chunk
        self.histograms: list[Histogram] = []
        self.flag_keys: list[RowKey] = []
        self.flags: list[torch.Tensor | tuple[Row, RowFiniteness]] = []

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: RowKey, row: Row | RowGroup) -> None:
        """One [ops] row, or a RowGroup that will be one row when the step's rows are taken.
        Rows added one by one are stacked together later: one kernel for a run of them instead
        of one reshaping call each (a hook adds one per activation)."""
        self.keys.append(key)
        self._single.append(row)

    def _close_run(self) -> None:
        if self._single:  # stacked in take(): a RowGroup in the run may still grow
            self._chunks.append(self._single)
            self._sizes.append(len(self._single))
            self._single = []

    def add_many(self, keys: list[RowKey], rows: torch.Tensor) -> None:
        if keys:
            self._close_run()
            self.keys.extend(keys)
            self._chunks.append(rows)
            self._sizes.append(len(keys))

    def add_flag(self, key: RowKey, finite: torch.Tensor) -> None:
        """For the non-finite origin: a 0-d floating witness, finite exactly when the tensor is
        free of NaN/Inf (its sum, its largest magnitude), tested with the step's other flags when
        they are taken; or a 0-d bool, the answer itself."""
        self.flag_keys.append(key)
        self.flags.append(finite)

    def add_flag_of_row(self, key: RowKey, row: Row, test: RowFiniteness) -> None:
        """The flag of a tensor whose statistics row was taken already: told by the row when the
        step's flags are taken, all such rows in one batch (msmon.runtime.row_finiteness)."""
        self.flag_keys.append(key)
        self.flags.append((row, test))

    def take(
        self,
    ) -> tuple[list[RowKey], list[torch.Tensor], list[Histogram], list[RowKey], torch.Tensor | None]:
        """Hand over everything recorded so far and start empty; the flags as one [n] bool tensor."""
        keys, chunks = self._settled()
        flag_keys, flags = _without_lost(self.flag_keys, self.flags)
        taken = keys, chunks, self.histograms, flag_keys, _resolved_flags(flags)
        self.keys, self._chunks, self._sizes, self.histograms, self.flag_keys, self.flags = [], [], [], [], [], []
        return taken

    def rows_so_far(self) -> tuple[list[RowKey], list[torch.Tensor]]:
        """The rows recorded so far, each read and stacked, left in place for `take` (a decision
        taken before the step ends reads them: alert.actions' skip_step)."""
        keys, chunks = self._settled()
        self.keys, self._chunks, self._sizes = keys, list(chunks), [chunk.shape[0] for chunk in chunks]
        return keys, chunks

    def _settled(self) -> tuple[list[RowKey], list[torch.Tensor]]:
        """The keys and the row chunks so far, pending rows read, lost rows left out with their keys."""
        self._close_run()
        chunks: list[torch.Tensor] = []
        lost: list[int] = []  # indices of the keys whose rows were lost
        start = 0
        for chunk, size in zip(self._chunks, self._sizes):
            if isinstance(chunk, torch.Tensor):
                chunks.append(chunk)
                start += size
                continue
            rows = [r.combined() if isinstance(r, RowGroup) else resolved(r) for r in chunk]
            kept = cast("list[torch.Tensor]", list(filter(_present, rows)))  # no bytecode per row
            if len(kept) < len(rows):
                lost.extend(start + i for i, row in enumerate(rows) if row is None)
            if kept:
                chunks.extend(_stacked(kept))
            start += len(rows)
        keys = self.keys
        if lost:
            gone = set(lost)
            keys = [key for i, key in enumerate(keys) if i not in gone]
        return keys, chunks

    def clear(self) -> None:
        """Forget everything recorded so far (nothing is computed)."""
        self.keys, self._single, self._chunks, self._sizes = [], [], [], []
        self.histograms, self.flag_keys, self.flags = [], [], []


def _without_lost(
    keys: list[RowKey], entries: list[torch.Tensor | tuple[Row, RowFiniteness]]
) -> tuple[list[RowKey], list[torch.Tensor | tuple[torch.Tensor, RowFiniteness]]]:
    """The flags with their pending rows read, those of lost rows left out with their keys."""
    out_keys: list[RowKey] = []
    out: list[torch.Tensor | tuple[torch.Tensor, RowFiniteness]] = []
    for key, entry in zip(keys, entries):
        if isinstance(entry, tuple):
            row = resolved(entry[0])
            if row is None:
                continue
            entry = (row, entry[1])
        out_keys.append(key)
        out.append(entry)
    return out_keys, out


def _resolved_flags(entries: list[torch.Tensor | tuple[torch.Tensor, RowFiniteness]]) -> torch.Tensor | None:
    """The step's flags in order as one [n] bool tensor: a kernel per run of flags of one kind
    (0-d flags stacked; rows stacked and tested together), not one per flag."""
    if not entries:
        return None
    parts: list[torch.Tensor] = []
    start = 0
    while start < len(entries):
        of_rows = isinstance(entries[start], tuple)
        end = start + 1
        while end < len(entries) and isinstance(entries[end], tuple) == of_rows:
            end += 1
        run = entries[start:end]
        if of_rows:
            pairs = [entry for entry in run if isinstance(entry, tuple)]
            test = pairs[0][1]  # one step, one set of ops
            parts.append(test.flags(_stack_on_one_device([row for row, _ in pairs])))
        else:  # witnesses (a bool answer as a witness: 0 for True, -inf for False), tested at once
            flags = [
                entry if entry.is_floating_point() else entry.double().log()
                for entry in run
                if isinstance(entry, torch.Tensor)
            ]
            parts.append(torch.isfinite(_stack_on_one_device(flags)))
        start = end
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p.to(parts[0].device) for p in parts])


def _stack_on_one_device(tensors: list[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(tensors)
    except RuntimeError:  # on several devices
        return torch.stack([t.to(tensors[0].device) for t in tensors])


def _stacked(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """A run of single rows as one [n, ops] chunk (one per row if they are on several devices:
    stage_to_host groups chunks by device)."""
    try:
        return [torch.stack(rows)]
    except RuntimeError:
        return [r.unsqueeze(0) for r in rows]

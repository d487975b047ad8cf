"""`category_ops`: a category's rows keep only its own ops in the output (msprobe V2's per-monitor
ops), on the writer thread.

The statistics are computed once per tensor for every op of `ops` (one pass, whatever the
category); here the step's record is cut, for the sinks, into one record per set of kept ops, in
the order the categories first appear, each holding its rows with their columns only. The
consumers (the alert rules, the rank comparison, the tracker lanes) still get the whole record.
The grouping is kept from step to step while the rows stay the same, as they do.
"""

from __future__ import annotations

import torch

from ..records.rows import RowKey, StepRecord


class CategoryColumns:
    """Cuts each step's record by `category_ops` ({category: ops}; a category not named keeps every op)."""

    def __init__(self, category_ops: dict[str, list[str]]) -> None:
        self.category_ops = category_ops
        self._keys: list[RowKey] = []
        self._ops: list[str] = []
        self._groups: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []

    def kept(self, category: str, ops: list[str]) -> list[str]:
        """The ops of `ops` that rows of `category` keep, in the order of `ops`."""
        own = self.category_ops.get(category)
        return list(ops) if own is None else [op for op in ops if op in own]

    def _grouped(self, keys: list[RowKey], ops: list[str]) -> list[tuple[list[str], torch.Tensor, torch.Tensor]]:
        """(kept ops, their column indices, the rows keeping them) per set of kept ops."""
        if keys != self._keys or ops != self._ops:
            rows: dict[tuple[str, ...], list[int]] = {}
            for i, key in enumerate(keys):
                rows.setdefault(tuple(self.kept(key.category, ops)), []).append(i)
            self._keys, self._ops = list(keys), list(ops)
            self._groups = [
                (list(kept), torch.tensor([ops.index(op) for op in kept], dtype=torch.long), torch.tensor(index))
                for kept, index in rows.items()
                if kept  # a category none of whose ops is computed this step writes nothing
            ]
        return self._groups

    def split(self, record: StepRecord) -> list[StepRecord]:
        """The records the sinks write for `record` (itself when every row keeps every op); the
        step's histograms go with the first."""
        if not self.category_ops or not record.keys:
            return [record]
        groups = self._grouped(record.keys, record.ops)
        if len(groups) == 1 and groups[0][0] == record.ops:
            return [record]
        table = record.table
        if table is None or tuple(table.shape) != (len(record.keys), len(record.ops)):
            table = torch.tensor(record.values, dtype=torch.float64).reshape(len(record.keys), len(record.ops))
        out: list[StepRecord] = []
        for kept, columns, rows in groups:
            out.append(
                StepRecord(
                    step=record.step,
                    rank=record.rank,
                    ops=kept,
                    keys=[record.keys[i] for i in rows.tolist()],
                    histograms=record.histograms if not out else [],
                    meta=record.meta,
                    table=table.index_select(0, rows).index_select(1, columns),
                )
            )
        return out

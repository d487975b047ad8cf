"""The by_rank layout's summary lanes: a handful of TensorBoard series per rank instead of one
per tensor and op.

For each category of the step (grad_reduced, actv, ...) and each op, the largest value over the
category's tensors is a scalar `summary/{category}/{op}_max`, and one text table per step
(`summary/max_holders`) names the tensor holding each. A NaN is the largest value (torch.max
propagates it), so a lane turns NaN at the step a tensor of its category does, and the table
names the first such tensor. Computed on the writer thread from the host tables the sink writes:
one step's statistics and its column categories' rows (loss, grad_agreement, ...) give one table.
The grouping by category and the maxima (`CategoryRows`, `category_maxima`) are the trackers'
lanes too (collectors/trackers/lanes.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ...records.layout import SUMMARY_HOLDERS_TAG, summary_tag
from ...records.rows import RowKey
from . import summary_wire


class CategoryRows:
    """The step's rows grouped by category: (category, its rows, the same as an index tensor),
    in the order categories first appear; kept while the keys stay the same, as they do from
    step to step (the comparison of the same RowKey objects is one C loop, grouping them again a
    Python loop per row)."""

    def __init__(self) -> None:
        self._keys: list[RowKey] = []
        self._groups: list[tuple[str, list[int], torch.Tensor]] = []

    def groups(self, keys: list[RowKey]) -> list[tuple[str, list[int], torch.Tensor]]:
        if keys != self._keys:
            rows: dict[str, list[int]] = {}
            for i, key in enumerate(keys):
                rows.setdefault(key.category, []).append(i)
            self._keys = list(keys)
            self._groups = [(category, index, torch.tensor(index)) for category, index in rows.items()]
        return self._groups


def category_maxima(table: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of `table`, the largest value over `rows` (a NaN is the largest) and the position
    in `rows` of the first row holding it."""
    return table.index_select(0, rows).max(dim=0)


class SummaryLanes:
    """The lanes' Summary.value entries of one step, for the TensorBoard sink."""

    def __init__(self, summary: Any) -> None:  # tensorboard's Summary class
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        self._value = summary.Value
        self._text_metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        self._tensor, self._shape, self._string = TensorProto, TensorShapeProto, types_pb2.DT_STRING
        self._prefixes: dict[tuple[str, str], bytes] = {}
        self._rows: list[CategoryRows] = []  # one per table of the step, in the order they come

    def _grouped(self, position: int, keys: list[RowKey]) -> list[tuple[str, list[int], torch.Tensor]]:
        """The categories of the keys of the step's table at `position` (the statistics, then each
        category with ops or columns of its own), each table's grouping kept from step to step."""
        while len(self._rows) <= position:
            self._rows.append(CategoryRows())
        return self._rows[position].groups(keys)

    def entries(self, tables: list[tuple[list[RowKey], list[str], torch.Tensor]]) -> list[bytes]:
        """The lanes' scalar entries and the holders' one text entry of a step, from each of the
        step's [rows, ops] tables with its keys and ops: the statistics and the categories with
        their own columns (the loss, the gradient agreement, the L2 features) are written as
        separate tables of one step, and TensorBoard keeps one text per tag and step."""
        prefixes: list[bytes] = []
        maxima: list[torch.Tensor] = []
        lines = ["| category | op | max | tensor |", "|---|---|---|---|"]
        for position, (keys, ops, table) in enumerate(tables):
            for category, index, rows in self._grouped(position, keys):
                values, where = category_maxima(table, rows)
                maxima.append(values)
                holders = where.tolist()
                for j, (op, value) in enumerate(zip(ops, values.tolist())):
                    prefixes.append(self._prefix(category, op))
                    lines.append(f"| {category} | {op} | {value:.6g} | {keys[index[holders[j]]].display_name()} |")
        if not prefixes:
            return []
        scalars = summary_wire.scalars(prefixes, summary_wire.float32_bytes(torch.cat(maxima)))
        return [scalars, summary_wire.entry(self._text("\n".join(lines)))]

    def _prefix(self, category: str, op: str) -> bytes:
        prefix = self._prefixes.get((category, op))
        if prefix is None:
            prefix = self._prefixes[(category, op)] = summary_wire.scalar_prefix(summary_tag(category, op))
        return prefix

    def _text(self, markdown: str) -> bytes:
        """A serialized Summary.Value of TensorBoard's text plugin (a scalar string tensor)."""
        tensor = self._tensor(dtype=self._string, tensor_shape=self._shape(), string_val=[markdown.encode("utf-8")])
        return self._value(tag=SUMMARY_HOLDERS_TAG, metadata=self._text_metadata, tensor=tensor).SerializeToString()

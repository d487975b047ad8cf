"""A batch's fields from the compiled pass: every element read once, kernels flat in the tensor count.

The chunks of the batch (msmon.stats.flat_layout: spans read in place, small tensors staged
once into a reused buffer) are cut into rows (msmon.stats.block_rows) and each chunk is reduced
by at most two calls of the compiled kernel (msmon.stats.fused_rows): one over its own
[blocks, BLOCK] view, one over the few blocks where tensors meet. A 16-bit chunk is widened
inside the kernel, not copied. The rows of all chunks are then combined per tensor in float64
in four kernels (a gather into tensor order, two segmented reductions, the NaN rule), exactly:
sums of squares, sums and counts add, max and -min take the max, and a tensor holding a NaN
has NaN as its min and max (the sum of squares is NaN exactly when an element is), whatever the
device's max does with NaN.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from . import fused_rows
from .block_rows import SKIP, BlockRows, block_rows
from .flat_layout import Chunk
from .fused_rows import BLOCK, FIELDS
from .inputs import RESULT_DTYPE, _to_device, indices_on_device
from .plan import _plan

_MAXED = ("max", "negmax")  # combined by a max; every other field by a sum


def fields_for(op_fields: Sequence[str]) -> tuple[str, ...]:
    """The fields the compiled pass computes for ops reading `op_fields` (the op table's field
    names), in FIELDS' order: what they read, and the sum of squares as the NaN witness of min
    and max. On a CPU the pass is bound by its instructions, so a field nobody asked for (infs,
    say) is not computed."""
    asked = set(op_fields)
    wanted = {
        "sq": bool({"norm", "min", "max"} & asked),
        "sum": "sum" in asked,
        "zeros": "zeros" in asked,
        "nans": "nans" in asked,
        "infs": "infs" in asked,
        "max": "max" in asked,
        "negmax": "min" in asked,
    }
    return tuple(name for name in FIELDS if wanted[name])


def fields_of_ops(ops: Sequence[str]) -> tuple[str, ...]:
    """The fields the compiled pass computes for these ops (names in the op table)."""
    return fields_for(_plan(tuple(ops)).op_fields)


def prepare_for(tensors: list[torch.Tensor], ops: Sequence[str]) -> None:
    """Compile (or load) the pass for these tensors and the fields `ops` read now, between steps
    (at attach, when the ops change), not on first use inside a hook: a compile takes seconds."""
    fused_rows.prepare(tensors, fields_of_ops(ops))


@functools.lru_cache(maxsize=512)
def _bounds(rows: BlockRows, device: torch.device) -> torch.Tensor:
    """[rows, 2] columns [lo, hi) of each boundary row, on the device once per layout."""
    return _to_device(torch.tensor(list(zip(rows.boundary_lo, rows.boundary_hi)), dtype=torch.long), device)


@functools.lru_cache(maxsize=512)
def _gathered(rows: BlockRows, device: torch.device) -> torch.Tensor | None:
    """The view's blocks the boundary matrix copies (the padded tail aside), on the device once
    per layout; None when it copies none."""
    blocks = tuple(b for b in rows.boundary_blocks if b < rows.view_rows)
    return indices_on_device(blocks, device) if blocks else None


@functools.lru_cache(maxsize=64)
def _threshold(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The zero threshold as a 0-d tensor (a tensor argument: one compiled code for every value)."""
    return _to_device(torch.tensor(value, dtype=dtype), device)


@functools.lru_cache(maxsize=128)
def _tensor_order(
    layouts: tuple[BlockRows, ...], count: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: the rows of each tensor in tensor order (rows of SKIP left out), and how
    many each has, for chunks of these layouts stacked in order. Keyed by the layouts' identity
    (block_rows makes one object per layout), so a repeated batch hashes a few objects, not
    every row."""
    by_tensor: list[list[int]] = [[] for _ in range(count)]
    position = 0
    for layout in layouts:
        for tensor in layout.tensors:
            if tensor != SKIP:
                by_tensor[tensor].append(position)
            position += 1
    positions = tuple(p for rows in by_tensor for p in rows)
    return indices_on_device(positions, device), indices_on_device(tuple(len(rows) for rows in by_tensor), device)


def _tail_in_place(x: torch.Tensor) -> bool:
    """Whether x's storage holds the whole last block past x's end (so it is read in place)."""
    rows = -(-x.numel() // BLOCK)
    return (x.storage_offset() + rows * BLOCK) * x.element_size() <= x.untyped_storage().nbytes()


def _boundary(x: torch.Tensor, view: torch.Tensor | None, rows: BlockRows) -> torch.Tensor:
    """The boundary matrix: copies of the blocks where pieces meet, and the zero-padded tail."""
    parts = []
    gathered = _gathered(rows, x.device)
    if gathered is not None:
        assert view is not None
        parts.append(view.index_select(0, gathered))
    padded = len(rows.boundary_blocks) - (0 if gathered is None else gathered.numel())
    if padded:
        tail = x[rows.blocks * BLOCK :]
        parts.append(torch.nn.functional.pad(tail, (0, BLOCK - tail.numel())).expand(padded, BLOCK))
    return torch.cat(parts) if len(parts) > 1 or parts[0].stride(0) == 0 else parts[0]


def chunk_rows(
    x: torch.Tensor, chunk: Chunk, threshold: torch.Tensor, fields: tuple[str, ...]
) -> tuple[list[torch.Tensor], BlockRows] | None:
    """The per-row values of `fields` of one chunk (x: its elements, flat, in their own dtype) and
    its rows' layout (the tensor of each row); None when the compiled pass failed."""
    rows = block_rows(tuple(chunk.pieces), x.numel(), _tail_in_place(x))
    view = x.as_strided((rows.view_rows, BLOCK), (BLOCK, 1)) if rows.view_rows else None
    values: list[torch.Tensor] = []
    if rows.main_rows:
        assert view is not None
        # whole blocks: a block where pieces meet is dropped
        main = fused_rows.row_values(view, None, threshold, fields)
        if main is None:
            return None
        values.append(main)
    if rows.boundary_blocks:
        bounds = _bounds(rows, x.device)
        edges = fused_rows.row_values(_boundary(x, view, rows), bounds, threshold, fields)
        if edges is None:
            return None
        values.append(edges)
    return values, rows


def combine(
    values: list[torch.Tensor], layouts: tuple[BlockRows, ...], count: int, fields: tuple[str, ...], needs: set[str]
) -> dict[str, torch.Tensor]:
    """Each tensor's fields (float64 columns, in tensor order) from the rows' values of `fields`:
    norm, max, min, sum, zeros, nans, infs as `needs` asks (names of the multi-tensor route's
    columns)."""
    device = values[0].device
    stacked = torch.cat(values) if len(values) > 1 else values[0]
    positions, lengths_t = _tensor_order(layouts, count, device)
    ordered = stacked.to(RESULT_DTYPE).index_select(0, positions)
    first_max = next((i for i, name in enumerate(fields) if name in _MAXED), len(fields))
    summed = torch.segment_reduce(ordered[:, :first_max], "sum", lengths=lengths_t, axis=0)
    column = {name: summed[:, i] for i, name in enumerate(fields[:first_max])}
    if first_max < len(fields):
        maxed = torch.segment_reduce(ordered[:, first_max:], "max", lengths=lengths_t, axis=0)
        column.update({name: maxed[:, i] for i, name in enumerate(fields[first_max:])})
    out: dict[str, torch.Tensor] = {}
    if {"max", "min"} & needs:
        has_nan = torch.isnan(column["sq"])
        if "max" in needs:
            out["max"] = torch.where(has_nan, math.nan, column["max"])
        if "min" in needs:
            out["min"] = torch.where(has_nan, math.nan, column["negmax"].neg())
    if "norm" in needs:
        out["norm"] = column["sq"].sqrt()
    for name in ("sum", "zeros", "nans", "infs"):
        if name in needs:
            out[name] = column[name]
    return out

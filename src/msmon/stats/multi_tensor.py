"""The accelerator path of the statistics: every op of a whole batch in a fixed number of kernels.

On a CUDA or NPU device each torch op is at least one kernel launch plus its Python dispatch
(5-20 µs of host time). Reducing tensor by tensor, as the host path may on the CPU, costs about
ten launches per tensor: 3600 for the 360 tensors of a 13B model in one category. Here a batch
of one device and dtype is laid out as flat chunks (msmon.stats.flat_layout: views of the
storages that tensors share, views of large tensors, small tensors copied into a reused
staging buffer) and each chunk is reduced with about fifteen kernels whatever the number of
tensors in it: per-tensor values come from multi-tensor (`_foreach_*`) reductions over views of
the chunk's pieces and from one segmented sum, the elementwise work (|x|, the comparisons)
runs once over the chunk. Pieces of one tensor in several chunks, and all pieces of the batch,
are combined at the end in a handful of kernels. So launches grow with bytes/CHUNK, not with
tensors (benchmarks/op_counts.py counts them).

Per field, with x a chunk in the accumulation dtype (float32 for 16-bit and float32 input,
float64 for float64: a 16-bit chunk is converted once, exactly):

- norm: `_foreach_norm(pieces, 2)`; pieces combine as the root of summed squares (float64);
- max, min: `_foreach_max(pieces)`, and of -x; exact. A piece holding a NaN gives NaN: the NaN
  is found in the squares' sum (NaN exactly when an element is), so the result does not depend
  on how a device's max treats NaN;
- sum (the mean's): one `segment_reduce` over the chunk, gaps included then dropped;
- zeros, nans, infs: exact counts, `_foreach_norm(pieces, 1)` of a 0/1 float chunk (a piece
  holds at most CHUNK = 2**22 elements: exact in float32), summed in float64.

Memory stays bounded by the chunk: a few CHUNK-sized temporaries at a time, never one of a
tensor's or a buffer's size. Nothing is read back to the host. What is copied: small separate
tensors (each at most STAGE_MAX elements) once into the staging buffer, for every field at once
(`_foreach_norm` and `_foreach_max` alone would read them in place, but the other fields need
the elementwise passes over one flat chunk); 16-bit spans once into float32, a chunk at a time;
tensors that are not dense once by reshape. Tensors sharing a storage and large tensors are
read in place. Ops with their own reduction (op.compute) are computed tensor by tensor.
"""

from __future__ import annotations

import math
import threading

import torch

from . import fused_batch, fused_rows
from .flat_layout import CHUNK, GAP, Chunk, chunks_of
from .inputs import RESULT_DTYPE, indices_on_device
from .plan import _Plan

# the per-piece values stacked per chunk, in this order (those the plan needs)
_PIECE_FIELDS = ("sq", "max", "negmax", "zeros", "nans", "infs")
_MAXED = ("max", "negmax")  # combined over a tensor's pieces by max; the others by sum


class _Scratch(threading.local):
    """CHUNK-sized buffers per (device, dtype, stream, use), reused: the staging copy, |x| or -x,
    and the 0/1 indicators. A step's batches repeat, and fresh chunk-sized temporaries each time
    would cost the allocator (on the CPU, page faults that cost more than the arithmetic). Reuse
    is safe in stream order: the kernels reading one fill are queued before the next fill."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, device: torch.device, dtype: torch.dtype, use: str) -> torch.Tensor:
        key = (device, dtype, _stream(device), use)
        buf = self.buffers.get(key)
        if buf is None:
            if len(self.buffers) > 24:
                self.buffers.clear()
            buf = self.buffers[key] = torch.empty(CHUNK, dtype=dtype, device=device)
        return buf


def _stream(device: torch.device) -> object:
    if device.type == "cpu":
        return None
    try:
        return torch.get_device_module(device.type).current_stream(device)
    except (AttributeError, RuntimeError):
        return object()  # no stream to key by: a buffer of its own (never reused)


_scratch = _Scratch()


def _needs(plan: _Plan) -> tuple[str, ...]:
    fields = set(plan.op_fields)
    wanted = {
        "sq": plan.norm or plan.minmax,  # the norm, and the NaN witness of min and max
        "max": "max" in fields,
        "negmax": "min" in fields,
        "zeros": plan.zeros,
        "nans": "nans" in fields,
        "infs": "infs" in fields,
    }
    return tuple(name for name in _PIECE_FIELDS if wanted[name])


def _chunk_values(chunk: Chunk, x: torch.Tensor, needs: tuple[str, ...], threshold: float) -> torch.Tensor | None:
    """[len(needs), pieces] per-piece values of one chunk (x, in the accumulation dtype), the
    pieces of gaps left out; None when no such value is wanted."""
    lengths = [length for _, length in chunk.pieces]
    kept = [i for i, (row, _) in enumerate(chunk.pieces) if row != GAP]

    def pieces(t: torch.Tensor) -> list[torch.Tensor]:
        views = t.split(lengths)
        return [views[i] for i in kept]

    by_field: dict[str, list[torch.Tensor]] = {}
    if "sq" in needs:
        by_field["sq"] = list(torch._foreach_norm(pieces(x), 2))
    if "max" in needs:
        by_field["max"] = list(torch._foreach_max(pieces(x)))
    work = _scratch.get(x.device, x.dtype, "work")[: x.numel()]
    mask = _scratch.get(x.device, x.dtype, "mask")[: x.numel()]  # 0/1 indicators, counted by 1-norms
    if "zeros" in needs or "infs" in needs:
        torch.abs(x, out=work)
        if "zeros" in needs:
            by_field["zeros"] = list(torch._foreach_norm(pieces(torch.lt(work, threshold, out=mask)), 1))
        if "infs" in needs:
            by_field["infs"] = list(torch._foreach_norm(pieces(torch.eq(work, math.inf, out=mask)), 1))
    if "nans" in needs:
        by_field["nans"] = list(torch._foreach_norm(pieces(torch.ne(x, x, out=mask)), 1))
    if "negmax" in needs:
        by_field["negmax"] = list(torch._foreach_max(pieces(torch.neg(x, out=work))))
    values = [v for name in needs for v in by_field[name]]
    return torch.stack(values).view(len(needs), len(kept)) if values else None


def _chunk_sums(chunk: Chunk, x: torch.Tensor) -> torch.Tensor:
    """Per-piece sums of one chunk (gaps dropped), in x's dtype."""
    lengths = tuple(length for _, length in chunk.pieces)
    sums = torch.segment_reduce(x, "sum", lengths=indices_on_device(lengths, x.device))
    kept = tuple(i for i, (row, _) in enumerate(chunk.pieces) if row != GAP)
    return sums if len(kept) == len(lengths) else sums.index_select(0, indices_on_device(kept, x.device))


def _read(chunk: Chunk, acc: torch.dtype, device: torch.device) -> torch.Tensor:
    """The chunk's elements as one flat tensor in dtype `acc` (the `_foreach_*` route: the
    accumulation dtype; the compiled pass: the tensors' own, read in place where they are a view)."""
    buf = _scratch.get(device, acc, "staging")[: chunk.size]
    if chunk.view is not None:
        return chunk.view if chunk.view.dtype == acc else buf.copy_(chunk.view)
    return torch.cat(chunk.staged, out=buf)


def batch_columns(ts: list[torch.Tensor], plan: _Plan, threshold: float) -> torch.Tensor:
    """Unscaled [len(ts), ops] float64 rows (sums and counts, in the engine's ops order) of
    tensors of one device and dtype, none empty; no host read. Where the device has a compiler,
    one compiled pass per chunk reads every element once (msmon.stats.fused_batch); otherwise,
    or if it fails, the `_foreach_*` route below."""
    device = ts[0].device
    acc = plan.accumulate(ts[0].dtype)
    needs = _needs(plan)
    want_sum = "sum" in plan.op_fields
    chunks = chunks_of(ts)
    columns: dict[str, torch.Tensor] | None = None
    order: tuple[int, ...] = tuple(range(len(ts)))
    # a derived op's bases are summed in float64: the `_foreach_*` route reads the chunks in it
    if (needs or want_sum) and not plan.derived and fused_rows.usable(device):
        columns = _fused_columns(ts, chunks, plan, threshold, acc)
    if columns is None:
        columns, order = _foreach_columns(chunks, needs, want_sum, threshold, acc, device)
    for name, compute in plan.own:
        columns[name] = torch.stack([compute(ts[row], acc) for row in order]).to(RESULT_DTYPE)
    rows = torch.stack([columns[f] for f in plan.op_fields], dim=1)
    if order != tuple(range(len(ts))):
        rows = rows.index_select(0, indices_on_device(_inverse(order), device))
    return rows


def _fused_columns(
    ts: list[torch.Tensor], chunks: list[Chunk], plan: _Plan, threshold: float, acc: torch.dtype
) -> dict[str, torch.Tensor] | None:
    """The fields of the batch from the compiled pass, in tensor order; None when it failed."""
    device = ts[0].device
    limit = fused_batch._threshold(threshold, acc, device)
    fields = fused_batch.fields_for(plan.op_fields)
    values: list[torch.Tensor] = []
    layouts = []
    for chunk in chunks:
        got = fused_batch.chunk_rows(_read(chunk, ts[0].dtype, device), chunk, limit, fields)  # in its own dtype
        if got is None:
            return None
        values.extend(got[0])
        layouts.append(got[1])
    return fused_batch.combine(values, tuple(layouts), len(ts), fields, set(plan.op_fields))


def _foreach_columns(
    chunks: list[Chunk],
    needs: tuple[str, ...],
    want_sum: bool,
    threshold: float,
    acc: torch.dtype,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """The fields of the batch by `_foreach_*` reductions, and the order of its tensors in them."""
    stacks: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    rows_of_pieces: list[int] = []
    for chunk in chunks:
        rows_of_pieces.extend(row for row, _ in chunk.pieces if row != GAP)
        if not needs and not want_sum:  # only ops with their own reduction: nothing to read here
            continue
        x = _read(chunk, acc, device)
        stacked = _chunk_values(chunk, x, needs, threshold)
        if stacked is not None:
            stacks.append(stacked)
        if want_sum:
            sums.append(_chunk_sums(chunk, x))
        del x
    columns = _combine(stacks, sums, needs, tuple(rows_of_pieces), device)
    return columns, tuple(dict.fromkeys(rows_of_pieces))  # each row once, in computed order


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return tuple(inverse)


def _combine(
    stacks: list[torch.Tensor],
    sums: list[torch.Tensor],
    needs: tuple[str, ...],
    rows_of_pieces: tuple[int, ...],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Each tensor's fields (float64 columns, in computed order) from its pieces' values."""
    counts = tuple(_run_lengths(rows_of_pieces))
    split = len(counts) != len(rows_of_pieces)  # some tensor has several pieces
    lengths = indices_on_device(counts, device) if split else None
    out: dict[str, torch.Tensor] = {}
    if stacks:
        values = torch.cat(stacks, dim=1).to(RESULT_DTYPE) if len(stacks) > 1 else stacks[0].to(RESULT_DTYPE)
        if "sq" in needs:
            sq_row = needs.index("sq")
            values[sq_row].square_()
        if split:
            values_t = values.t()  # [pieces, fields]: segments along dim 0
            summed = torch.segment_reduce(values_t, "sum", lengths=lengths).t()
            maxed = torch.segment_reduce(values_t, "max", lengths=lengths).t() if set(_MAXED) & set(needs) else None
        else:
            summed, maxed = values, values
        for i, name in enumerate(needs):
            out[name] = (maxed if name in _MAXED else summed)[i]  # type: ignore[index]
    if "sq" in out:
        has_nan = torch.isnan(out["sq"])
        if "max" in out:
            out["max"] = torch.where(has_nan, math.nan, out["max"])
        if "negmax" in out:
            out["min"] = torch.where(has_nan, math.nan, out.pop("negmax").neg())
        out["norm"] = out.pop("sq").sqrt()
    if sums:
        total = torch.cat(sums) if len(sums) > 1 else sums[0]
        total = total.to(RESULT_DTYPE)
        out["sum"] = torch.segment_reduce(total, "sum", lengths=lengths) if split else total
    return out


def _run_lengths(rows: tuple[int, ...]) -> list[int]:
    counts: list[int] = []
    previous = None
    for row in rows:
        if row == previous:
            counts[-1] += 1
        else:
            counts.append(1)
            previous = row
    return counts

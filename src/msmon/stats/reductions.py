"""The torch path of the statistics: the reductions of tensors the native kernel does not read.

Speed is what lets the monitor stay on. Each op is one reduction kernel per tensor, and all
results of a call are assembled with one stack. On the CPU three more things matter, each
measured (docs/performance.md):

- Large tensors are read in cache-sized chunks and every reduction runs on a chunk while it
  is in cache, so a tensor comes from memory once, not once per op.
- The zero count writes |x| and the comparison into a small per-thread scratch buffer
  instead of full-size temporaries, whose page faults cost more than the arithmetic.
- nan/inf counts are skipped when provably zero: min and max (or the sum) are finite only
  if no element is NaN or infinite. Reading that CPU scalar waits for nothing. On
  accelerators the counts are always computed on the device, so nothing synchronises
  (MSMON_DEVICE_PATH=1, msmon.stats.device_path, makes the CPU take the accelerators' code
  throughout; `CPU_SHORTCUTS = False` turns off this read alone).
"""

from __future__ import annotations

import functools
import math
import threading

import torch

from .device_path import host_code
from .inputs import RESULT_DTYPE, _accumulate_dtype, _to_device, zero_threshold
from .plan import _Plan

CHUNK = 1 << 18  # elements per CPU pass: 1 MiB of float32, read once, then reduced in cache
SMALL = 1 << 12  # tensors up to this size are reduced together, as segments of one buffer
_MIN_SEGMENTS = 4  # fewer small tensors than this are cheaper one by one
_EXACT_F32_COUNT = 1 << 24  # counts up to this are exact in float32
CPU_SHORTCUTS = True  # read CPU scalars to skip provably-zero counts (see the module docstring)


def _reads_are_free(t: torch.Tensor) -> bool:
    """Whether reading `t`'s values on the host waits for nothing (a CPU tensor)."""
    return CPU_SHORTCUTS and host_code(t.device)


class _Scratch(threading.local):
    """Per-thread CPU scratch for the zero count: one CHUNK-sized buffer per dtype, and
    views of it shaped like the tensors seen (cached: a view costs as much as a small
    reduction)."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.views: dict[tuple[torch.dtype, torch.Size], torch.Tensor] = {}

    def like(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.shape)
        view = self.views.get(key)
        if view is None:
            buf = self.buffers.get(t.dtype)
            if buf is None:
                buf = self.buffers[t.dtype] = torch.empty(CHUNK, dtype=t.dtype)
            if len(self.views) > 512:
                self.views.clear()
            view = self.views[key] = buf[: t.numel()].view(t.shape)
        return view


_scratch = _Scratch()


def _count_small(t: torch.Tensor, threshold: float) -> torch.Tensor:
    """Number of elements with |x| < threshold (0-d). On the CPU, for at most CHUNK
    elements, through the scratch buffer: nothing of the tensor's size is allocated."""
    if not host_code(t.device):
        return torch.count_nonzero(t.abs() < threshold)
    if t.numel() > CHUNK:  # only non-contiguous tensors get here (contiguous ones are chunked)
        return torch.count_nonzero(t.abs() < threshold)
    work = torch.abs(t, out=_scratch.like(t))
    return torch.lt(work, threshold, out=work).sum(dtype=_accumulate_dtype(t.dtype))


def _chunked(t: torch.Tensor, plan: _Plan, threshold: float, acc: torch.dtype) -> dict[str, torch.Tensor]:
    """All reductions of a large contiguous CPU tensor, chunk by chunk: each chunk is read
    from memory once and reduced while it is in cache; the partial results are combined
    exactly (min of mins, sum of counts) or in float (norms in squares, sums)."""
    flat = t.view(-1)
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in plan.fields}
    for start in range(0, flat.numel(), CHUNK):
        piece = flat[start : start + CHUNK]
        if plan.norm:
            parts["norm"].append(torch.linalg.vector_norm(piece, dtype=acc))
        if plan.minmax:
            low, high = torch.aminmax(piece)
            parts["min"].append(low)
            parts["max"].append(high)
        if plan.total:
            parts["sum"].append(piece.sum(dtype=acc))
        if plan.zeros:
            parts["zeros"].append(_count_small(piece, threshold))
    out = {}
    if plan.norm:
        out["norm"] = torch.linalg.vector_norm(torch.stack(parts["norm"]))
    if plan.minmax:
        out["min"], out["max"] = torch.stack(parts["min"]).min(), torch.stack(parts["max"]).max()
    if plan.total:
        out["sum"] = torch.stack(parts["sum"]).sum()
    if plan.zeros:
        out["zeros"] = torch.stack(parts["zeros"]).sum(dtype=RESULT_DTYPE)
    return out


def _one(t: torch.Tensor, plan: _Plan, threshold: float, acc: torch.dtype) -> dict[str, torch.Tensor]:
    """All reductions of one tensor, as 0-d tensors by field."""
    if host_code(t.device) and t.numel() > CHUNK and t.is_contiguous():
        return _chunked(t, plan, threshold, acc)
    out = {}
    if plan.norm:
        out["norm"] = torch.linalg.vector_norm(t, dtype=acc)
    if plan.minmax:
        out["min"], out["max"] = torch.aminmax(t)
    if plan.total:
        out["sum"] = t.sum(dtype=acc)
    if plan.zeros:
        out["zeros"] = _count_small(t, threshold)
    return out


def _each(ts: list[torch.Tensor], plan: _Plan, threshold: float, acc: torch.dtype) -> dict[str, torch.Tensor]:
    """Columns ([n] tensors by field) of tensors reduced one by one (norms in one call)."""
    lists: dict[str, list[torch.Tensor]] = {name: [] for name in plan.fields}
    batch_norm = plan.norm and not any(host_code(t.device) and t.numel() > CHUNK for t in ts)
    for t in ts:
        values = _one(t, plan.without_norm if batch_norm else plan, threshold, acc)
        for name, value in values.items():
            lists[name].append(value)
    if batch_norm:
        lists["norm"] = list(torch._foreach_norm(ts, 2, dtype=acc))
    return {name: torch.stack(values) for name, values in lists.items()}


def _segmented(ts: list[torch.Tensor], plan: _Plan, threshold: float, acc: torch.dtype) -> dict[str, torch.Tensor]:
    """Columns of many small tensors reduced together: they are copied into one flat buffer
    (a few KiB; for small tensors the per-kernel cost, not the data, is what counts) and
    reduced per segment, so a batch costs about a dozen kernels instead of six per tensor."""
    flat = torch._utils._flatten_dense_tensors(ts)
    lengths, segment_ids = _layout(tuple(t.numel() for t in ts), flat.device)
    count = len(ts)
    wide = flat if flat.dtype == acc else flat.to(acc)
    out = {}
    if plan.norm:
        out["norm"] = torch.segment_reduce(wide * wide, "sum", lengths=lengths).sqrt_()
    if plan.minmax:
        out["min"] = torch.full((count,), math.inf, dtype=flat.dtype, device=flat.device).scatter_reduce_(
            0, segment_ids, flat, "amin"
        )
        out["max"] = torch.full((count,), -math.inf, dtype=flat.dtype, device=flat.device).scatter_reduce_(
            0, segment_ids, flat, "amax"
        )
    if plan.total:
        out["sum"] = torch.segment_reduce(wide, "sum", lengths=lengths)
    if plan.zeros:
        out["zeros"] = torch.segment_reduce(torch.lt(torch.abs(flat), threshold).to(acc), "sum", lengths=lengths)
    return out


# The small tensors built on the host for a batch's layout are cached per layout (and device), so
# a step neither builds them again nor copies them to an accelerator: a step's batches repeat.


@functools.lru_cache(maxsize=64)
def _layout(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment lengths and per-element segment ids of a flat copy of tensors of these sizes."""
    lengths = torch.tensor(numels, dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(len(numels)), lengths)
    return _to_device(lengths, device), _to_device(ids, device)


def _kind(t: torch.Tensor) -> str:
    return "segment" if t.numel() <= SMALL else "each"


def _columns(
    ts: list[torch.Tensor], plan: _Plan, threshold: float, acc: torch.dtype
) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    """Columns for all tensors, and the input position of each row (None: input order)."""
    kinds = [_kind(t) for t in ts]
    segments = [i for i, k in enumerate(kinds) if k == "segment"]
    if len(segments) < _MIN_SEGMENTS:
        return _each(ts, plan, threshold, acc), None
    if len(segments) == len(ts):
        return _segmented(ts, plan, threshold, acc), None
    rest = [i for i, k in enumerate(kinds) if k != "segment"]
    first = _segmented([ts[i] for i in segments], plan, threshold, acc)
    second = _each([ts[i] for i in rest], plan, threshold, acc)
    return {name: torch.cat([first[name], second[name]]) for name in first}, segments + rest


def _finite_rows(witness: list[torch.Tensor]) -> list[bool] | bool:
    """Which rows have all-finite witnesses ([n] CPU columns), or True when all do. Reading
    CPU values waits for nothing: there is no device."""
    finite = torch.isfinite(torch.stack(witness)) if len(witness) > 1 else torch.isfinite(witness[0])
    if finite.all().item():
        return True
    flags = finite.view(len(witness), -1).all(0) if len(witness) > 1 else finite
    return flags.tolist()


def _count_columns(ts: list[torch.Tensor], columns: dict[str, torch.Tensor], plan: _Plan) -> None:
    """Add the nans/infs columns: zeros where min/max (or the sum) prove there is nothing to
    count (CPU only), exact counts elsewhere."""
    n = len(ts)
    clean: list[bool] | bool = False
    if _reads_are_free(ts[0]):
        clean = _finite_rows([columns["min"], columns["max"]] if plan.minmax else [columns["sum"]])
    for field, test in (("nans", torch.isnan), ("infs", torch.isinf)):
        if field not in plan.op_fields:
            continue
        if clean is True:
            columns[field] = _zeros(n)
        else:
            flags = clean if isinstance(clean, list) else [False] * n
            columns[field] = torch.stack([_ZERO if ok else test(t).sum().to(RESULT_DTYPE) for t, ok in zip(ts, flags)])


def _own_columns(ts: list[torch.Tensor], columns: dict[str, torch.Tensor], plan: _Plan, acc: torch.dtype) -> None:
    """Add the columns of the ops with a reduction of their own (op.compute), tensor by tensor."""
    for field, compute in plan.own:
        columns[field] = torch.stack([compute(t, acc) for t in ts])


@functools.lru_cache(maxsize=64)
def _zeros(n: int) -> torch.Tensor:
    """A CPU column of n zero counts (never written to: shared)."""
    return torch.zeros(n, dtype=torch.float32)


_ZERO = torch.zeros((), dtype=RESULT_DTYPE)
_ZERO_OF = {
    dtype: torch.zeros((), dtype=dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def _zero_like(values: dict[str, torch.Tensor]) -> torch.Tensor:
    """A 0-d CPU zero of the values' common dtype (float64 when they differ)."""
    dtypes = {v.dtype for v in values.values()}
    return _ZERO_OF.get(dtypes.pop(), _ZERO) if len(dtypes) == 1 else _ZERO


def _row_values(t: torch.Tensor, plan: _Plan, eps: float) -> list[torch.Tensor]:
    """One tensor's unscaled row (sums and counts) as 0-d tensors in ops order: one kernel
    per reduction and, on the CPU, one read of a witness instead of two counting passes."""
    acc = plan.accumulate(t.dtype)
    values = _one(t, plan, zero_threshold(eps, t.dtype) if plan.zeros else 0.0, acc)
    for field, compute in plan.own:
        values[field] = compute(t, acc)
    clean = False
    if plan.flags and _reads_are_free(t):
        if plan.total:  # a finite sum means no NaN and no Inf (an overflow only costs the counts)
            clean = math.isfinite(values["sum"].item())
        else:
            clean = math.isfinite(values["min"].item()) and math.isfinite(values["max"].item())
    big = t.numel() > _EXACT_F32_COUNT
    # a zero of the other values' dtype: stacking one dtype costs a fifth of promoting a mix
    zero = _zero_like(values) if clean else _ZERO
    row = []
    for field in plan.op_fields:
        if field in ("nans", "infs"):
            if clean:
                row.append(zero)
            else:
                row.append((torch.isnan(t) if field == "nans" else torch.isinf(t)).sum().to(RESULT_DTYPE))
        else:
            value = values[field]
            row.append(value.to(RESULT_DTYPE) if big and field == "zeros" else value)
    return row

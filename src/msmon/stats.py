"""Statistics of tensors, computed on the tensors' own device without any host sync.

The result of every function here is a float64 tensor on the input's device, one row per
tensor and one column per op in the order asked for:

- norm: L2 norm, accumulated in float32 (float64 for float64 input);
- min, max: exact; mean: the sum (accumulated like the norm) divided by the element count;
- zeros: the fraction of elements with |x| < eps, compared exactly (as real numbers, so a
  float16 tensor counts its zeros even though eps=1e-8 is below float16's resolution);
- nans, infs: exact counts.

Speed is what lets the monitor stay on. Each op is one reduction kernel per tensor, and all
results of a call are assembled with one stack. On the CPU three more things matter, each
measured (docs/performance.md):

- Large tensors are read in cache-sized chunks and every reduction runs on a chunk while it
  is in cache, so a tensor comes from memory once, not once per op.
- The zero count writes |x| and the comparison into a small per-thread scratch buffer
  instead of full-size temporaries, whose page faults cost more than the arithmetic.
- nan/inf counts are skipped when provably zero: min and max (or the sum) are finite only
  if no element is NaN or infinite. Reading that CPU scalar waits for nothing. On
  accelerators the counts are always computed on the device, so nothing synchronises.
"""
from __future__ import annotations

import functools
import math
import threading
from collections import defaultdict
from typing import Sequence

import torch

RESULT_DTYPE = torch.float64
OPS = ("norm", "min", "max", "mean", "zeros", "nans", "infs")
CHUNK = 1 << 18  # elements per CPU pass: 1 MiB of float32, read once, then reduced in cache
_EXACT_F32_COUNT = 1 << 24  # counts up to this are exact in float32
_SCALED_OPS = ("mean", "zeros")  # the sum and the zero count are divided by numel


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a tensor (a DTensor's local shard, otherwise the tensor)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _as_stat_input(t: torch.Tensor) -> torch.Tensor:
    """The tensor detached, as floating point: integers and bools become exact floats."""
    t = local_tensor(t)
    if t.requires_grad:  # detached, nothing below records autograd (no no_grad context needed)
        t = t.detach()
    if t.is_floating_point():
        return t
    if t.is_complex():
        return torch.view_as_real(t)
    if t.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16):
        return t.to(torch.float32)
    return t.to(torch.float64)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=64)
def zero_threshold(eps: float, dtype: torch.dtype) -> float:
    """The smallest value of `dtype` that is >= eps.

    For every x of that dtype, |x| < eps (as real numbers) exactly when |x| < this value,
    so the comparison can run in the tensor's own dtype without rounding eps the wrong way.
    """
    value = torch.tensor(eps, dtype=torch.float64).to(dtype)
    if float(value) < eps:
        value = torch.nextafter(value, torch.tensor(math.inf, dtype=dtype))
    return float(value)


class _Plan:
    """Which reductions an ops list needs, decided once per list."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        for op in ops:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}; valid ops are {list(OPS)}")
        self.ops = ops
        self.norm = "norm" in ops
        self.minmax = "min" in ops or "max" in ops
        self.zeros = "zeros" in ops
        self.flags = "nans" in ops or "infs" in ops
        # the sum gives the mean, and is the NaN/Inf witness when min/max are not computed
        self.total = "mean" in ops or (self.flags and not self.minmax)
        self.scaled = any(op in _SCALED_OPS for op in ops)


@functools.lru_cache(maxsize=32)
def _plan(ops: tuple[str, ...]) -> _Plan:
    return _Plan(ops)


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
            view = self.views[key] = buf[:t.numel()].view(t.shape)
        return view


_scratch = _Scratch()


def _count_small(t: torch.Tensor, threshold: float) -> torch.Tensor:
    """Number of elements with |x| < threshold (0-d). On the CPU, for at most CHUNK
    elements, through the scratch buffer: nothing of the tensor's size is allocated."""
    if t.device.type != "cpu":
        return torch.count_nonzero(t.abs() < threshold)
    if t.numel() > CHUNK:  # only non-contiguous tensors get here (contiguous ones are chunked)
        return torch.count_nonzero(t.abs() < threshold)
    work = torch.abs(t, out=_scratch.like(t))
    return torch.lt(work, threshold, out=work).sum(dtype=_accumulate_dtype(t.dtype))


class _Values:
    """The unscaled results for one tensor: 0-d tensors (or None when not asked for)."""

    __slots__ = ("norm", "min", "max", "sum", "zeros", "clean")

    def __init__(self) -> None:
        self.norm = self.min = self.max = self.sum = self.zeros = None
        self.clean = False  # proven free of NaN and Inf


def _chunked(t: torch.Tensor, plan: _Plan, threshold: float, acc: torch.dtype) -> _Values:
    """All reductions of a large contiguous CPU tensor, chunk by chunk: each chunk is read
    from memory once and reduced while it is in cache; the partial results are combined
    exactly (min of mins, sum of counts) or in float (norms in squares, sums)."""
    flat = t.view(-1)
    norms, mins, maxs, sums, zeros = [], [], [], [], []
    for start in range(0, flat.numel(), CHUNK):
        piece = flat[start:start + CHUNK]
        if plan.norm:
            norms.append(torch.linalg.vector_norm(piece, dtype=acc))
        if plan.minmax:
            low, high = torch.aminmax(piece)
            mins.append(low)
            maxs.append(high)
        if plan.total:
            sums.append(piece.sum(dtype=acc))
        if plan.zeros:
            zeros.append(_count_small(piece, threshold))
    v = _Values()
    if plan.norm:
        v.norm = torch.linalg.vector_norm(torch.stack(norms))
    if plan.minmax:
        v.min, v.max = torch.stack(mins).min(), torch.stack(maxs).max()
    if plan.total:
        v.sum = torch.stack(sums).sum()
    if plan.zeros:
        v.zeros = torch.stack(zeros).sum(dtype=RESULT_DTYPE)
    return v


def _whole(ts: list[torch.Tensor], plan: _Plan, threshold: float, acc: torch.dtype) -> list[_Values]:
    """All reductions of tensors read whole: one kernel per op per tensor (norms batched)."""
    values = [_Values() for _ in ts]
    if plan.norm:
        norms = [torch.linalg.vector_norm(ts[0], dtype=acc)] if len(ts) == 1 else torch._foreach_norm(ts, 2, dtype=acc)
        for v, n in zip(values, norms):
            v.norm = n
    for v, t in zip(values, ts):
        if plan.minmax:
            v.min, v.max = torch.aminmax(t)
        if plan.total:
            v.sum = t.sum(dtype=acc)
        if plan.zeros:
            v.zeros = _count_small(t, threshold)
    return values


def _mark_clean(values: list[_Values], plan: _Plan) -> None:
    """On the CPU: which tensors are provably free of NaN and Inf (a finite min and max, or
    a finite sum). Reading CPU scalars waits for nothing: there is no device."""
    witness = [w for v in values for w in ((v.min, v.max) if plan.minmax else (v.sum,))]
    per = len(witness) // len(values)
    if len(values) == 1:
        values[0].clean = all(math.isfinite(w.item()) for w in witness)
        return
    finite = torch.isfinite(torch.stack(witness))
    if finite.all().item():
        flags = [True] * len(values)
    else:
        flat = finite.tolist()
        flags = [all(flat[i * per:(i + 1) * per]) for i in range(len(values))]
    for v, flag in zip(values, flags):
        v.clean = flag


_ZERO = torch.zeros((), dtype=torch.float32)


def _row(t: torch.Tensor, v: _Values, plan: _Plan) -> list[torch.Tensor]:
    """The row's 0-d values in ops order; counts are float64 when float32 could not hold them."""
    big = t.numel() > _EXACT_F32_COUNT
    row = []
    for op in plan.ops:
        if op == "norm":
            row.append(v.norm)
        elif op == "min":
            row.append(v.min)
        elif op == "max":
            row.append(v.max)
        elif op == "mean":
            row.append(v.sum)
        elif op == "zeros":
            row.append(v.zeros)
        elif v.clean:
            row.append(_ZERO)
        else:
            count = torch.isnan(t).sum() if op == "nans" else torch.isinf(t).sum()
            row.append(count.to(RESULT_DTYPE) if big else count)
    return row


def _parts(ts: list[torch.Tensor], plan: _Plan, eps: float) -> list[list[torch.Tensor]]:
    """Per tensor, its row of 0-d values (sums and counts, not yet means and fractions).
    All tensors share one device and dtype."""
    acc = _accumulate_dtype(ts[0].dtype)
    threshold = zero_threshold(eps, ts[0].dtype) if plan.zeros else 0.0
    on_cpu = ts[0].device.type == "cpu"
    chunked = [on_cpu and t.numel() > CHUNK and t.is_contiguous() for t in ts]
    if not any(chunked):
        values = _whole(ts, plan, threshold, acc)
    else:
        values = [None] * len(ts)
        whole = [i for i, c in enumerate(chunked) if not c]
        for i, v in zip(whole, _whole([ts[i] for i in whole], plan, threshold, acc) if whole else []):
            values[i] = v
        for i, c in enumerate(chunked):
            if c:
                values[i] = _chunked(ts[i], plan, threshold, acc)
    if plan.flags and on_cpu:
        _mark_clean(values, plan)
    return [_row(t, v, plan) for t, v in zip(ts, values)]


class _Divisors:
    """Cached [rows*ops] float64 divisors (numel for mean and zeros, 1 elsewhere), so a
    step neither builds them again nor copies them to an accelerator."""

    def __init__(self, size: int = 512) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}
        self._size = size

    def get(self, numels: tuple[int, ...], ops: tuple[str, ...], device: torch.device) -> torch.Tensor:
        key = (numels, ops, device)
        found = self._cache.get(key)
        if found is not None:
            return found
        values = [float(n) if op in _SCALED_OPS else 1.0 for n in numels for op in ops]
        if device.type == "cpu":
            made = torch.tensor(values, dtype=RESULT_DTYPE)
        else:  # from pinned memory the copy is asynchronous: no sync, even the first time
            made = torch.tensor(values, dtype=RESULT_DTYPE, pin_memory=True).to(device, non_blocking=True)
        if len(self._cache) >= self._size:
            self._cache.clear()
        self._cache[key] = made
        return made


_divisors = _Divisors()


def _assemble(rows: list[list[torch.Tensor]], numels: list[int], plan: _Plan,
              device: torch.device) -> torch.Tensor:
    """One stack for every value of every row, then the divisions, in float64."""
    flat = torch.stack([v for row in rows for v in row] if len(rows) > 1 else rows[0])
    flat = flat.to(device=device, dtype=RESULT_DTYPE)
    if plan.scaled:
        flat = flat / _divisors.get(tuple(numels), plan.ops, device)
    return flat.view(len(rows), len(plan.ops))


def _nan_rows(count: int, plan: _Plan, device: torch.device) -> torch.Tensor:
    return torch.full((count, len(plan.ops)), math.nan, dtype=RESULT_DTYPE, device=device)


def batch_stats(tensors: Sequence[torch.Tensor], ops: Sequence[str], eps: float) -> torch.Tensor:
    """Statistics of many tensors: a [len(tensors), len(ops)] float64 tensor.

    Tensors are grouped by (device, dtype); rows come back in input order on the first
    tensor's device. Empty tensors give NaN rows.
    """
    plan = _plan(tuple(ops))
    if not tensors:
        return torch.empty((0, len(plan.ops)), dtype=RESULT_DTYPE)
    prepared = [_as_stat_input(t) for t in tensors]
    device = prepared[0].device
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(prepared):
        if t.numel():
            groups[(t.device, t.dtype)].append(i)
    rows: list[list[torch.Tensor] | None] = [None] * len(prepared)
    for indices in groups.values():
        for i, row in zip(indices, _parts([prepared[i] for i in indices], plan, eps)):
            rows[i] = row
    numels = [t.numel() for t in prepared]
    if len(groups) == 1 and all(n for n in numels) and next(iter(groups))[0] == device:
        return _assemble(rows, numels, plan, device)
    out = _nan_rows(len(prepared), plan, device)
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if row is not None:
            by_device[prepared[i].device].append(i)
    for dev, indices in by_device.items():
        part = _assemble([rows[i] for i in indices], [numels[i] for i in indices], plan, dev)
        out[torch.tensor(indices, device=device)] = part.to(device, non_blocking=True)
    return out


def tensor_stats(tensor: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """Statistics of one tensor: a [len(ops)] float64 tensor on its device."""
    plan = _plan(tuple(ops))
    t = _as_stat_input(tensor)
    if t.numel() == 0:
        return _nan_rows(1, plan, t.device).view(-1)
    return _assemble(_parts([t], plan, eps), [t.numel()], plan, t.device).view(-1)


class StatRows:
    """Rows computed one tensor at a time (in hooks) and assembled once, at the end.

    `add` launches the reductions of one tensor right away (the tensor may change after the
    hook returns) and gives its row index; `rows()` builds the [n, ops] float64 tensor with
    one stack instead of one per tensor.
    """

    def __init__(self, ops: Sequence[str], eps: float) -> None:
        self.plan = _plan(tuple(ops))
        self.eps = eps
        self._rows: list[list[torch.Tensor] | None] = []
        self._numels: list[int] = []
        self._devices: list[torch.device] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, tensor: torch.Tensor) -> int:
        t = _as_stat_input(tensor)
        self._rows.append(_parts([t], self.plan, self.eps)[0] if t.numel() else None)
        self._numels.append(t.numel())
        self._devices.append(t.device)
        return len(self._rows) - 1

    def rows(self) -> torch.Tensor:
        """All rows so far, in the order added, on the first tensor's device."""
        if not self._rows:
            return torch.empty((0, len(self.plan.ops)), dtype=RESULT_DTYPE)
        device = self._devices[0]
        if all(r is not None for r in self._rows) and all(d == device for d in self._devices):
            return _assemble(self._rows, self._numels, self.plan, device)
        out = _nan_rows(len(self._rows), self.plan, device)
        for i, row in enumerate(self._rows):
            if row is not None:
                out[i] = _assemble([row], [self._numels[i]], self.plan, self._devices[i])[0].to(device)
        return out


def combine_rows(rows: torch.Tensor, counts: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """Exact statistics of a tensor from the statistics of its disjoint pieces.

    rows: [pieces, ops] statistics of each piece; counts: [pieces] element counts. Norms add
    in squares, min of mins, max of maxes, means weighted by count, zero counts recovered
    from each fraction (so the combined fraction is exactly the directly computed one), nan
    and inf counts add up. Empty pieces (count 0, NaN rows) are left out; if every piece is
    empty the result is a NaN row, like the statistics of an empty tensor. No host sync.
    """
    counts = counts.to(device=rows.device, dtype=rows.dtype)
    keep = counts > 0
    total = counts.sum()
    columns = []
    for j, op in enumerate(ops):
        col = rows[:, j]
        if op == "norm":
            columns.append(torch.where(keep, col, 0.0).square().sum().sqrt())
        elif op == "min":
            columns.append(torch.where(keep, col, math.inf).min())
        elif op == "max":
            columns.append(torch.where(keep, col, -math.inf).max())
        elif op == "mean":
            columns.append(torch.where(keep, col * counts, 0.0).sum() / total)
        elif op == "zeros":
            columns.append(torch.where(keep, torch.round(col * counts), 0.0).sum() / total)
        else:
            columns.append(torch.where(keep, col, 0.0).sum())
    return torch.where(total > 0, torch.stack(columns), math.nan)

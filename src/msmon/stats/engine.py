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
  accelerators the counts are always computed on the device, so nothing synchronises
  (`CPU_SHORTCUTS = False` makes the CPU take that read-free path too: the sync-free test
  runs the accelerators' logic that way).

Where the native kernel is loaded (msmon.native: built at the first attach where a C++
compiler is found, or by `msmon build-native`), plain contiguous float32/float64 CPU tensors
are read once for all ops, a whole batch per call, and the finished rows come back from it;
everything else takes the paths below.
"""

from __future__ import annotations

import functools
import math
import os
import struct
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from . import native
from .ops import BY_NAME, FIELDS, OPS, unknown  # noqa: F401 (OPS: msmon.stats.OPS, as before)

RESULT_DTYPE = torch.float64
CHUNK = 1 << 18  # elements per CPU pass: 1 MiB of float32, read once, then reduced in cache
SMALL = 1 << 12  # tensors up to this size are reduced together, as segments of one buffer
_MIN_SEGMENTS = 4  # fewer small tensors than this are cheaper one by one
_EXACT_F32_COUNT = 1 << 24  # counts up to this are exact in float32
CPU_SHORTCUTS = True  # read CPU scalars to skip provably-zero counts (see the module docstring)


def _reads_are_free(t: torch.Tensor) -> bool:
    """Whether reading `t`'s values on the host waits for nothing (a CPU tensor)."""
    return CPU_SHORTCUTS and t.device.type == "cpu"


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


_BITS = {torch.float64: ("d", "Q"), torch.float32: ("f", "I"), torch.float16: ("e", "H")}


@functools.lru_cache(maxsize=64)
def zero_threshold(eps: float, dtype: torch.dtype) -> float:
    """The smallest value of `dtype` that is >= eps.

    For every x of that dtype, |x| < eps (as real numbers) exactly when |x| < this value,
    so the comparison can run in the tensor's own dtype without rounding eps the wrong way.
    Found from the bit patterns on the host (no tensor, so no read of one inside a hook).
    """
    if not math.isfinite(eps) or eps <= 0:
        return eps
    if dtype == torch.bfloat16:  # the top half of a float32: round up to the next bfloat16
        bits = struct.unpack("<I", struct.pack("<f", zero_threshold(eps, torch.float32)))[0]
        if bits & 0xFFFF:
            bits = (bits | 0xFFFF) + 1
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    float_format, int_format = _BITS.get(dtype, _BITS[torch.float64])
    try:
        value = struct.unpack("<" + float_format, struct.pack("<" + float_format, eps))[0]
    except OverflowError:  # above the dtype's range: nothing of it is >= eps but inf
        return math.inf
    if value < eps:  # rounded down: the next representable value up
        bits = struct.unpack("<" + int_format, struct.pack("<" + float_format, value))[0] + 1
        value = struct.unpack("<" + float_format, struct.pack("<" + int_format, bits))[0]
    return value


class _Plan:
    """Which reductions an ops list needs, decided once per list."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        for op in ops:
            if op not in BY_NAME:
                raise ValueError(unknown(op))
        self.ops = ops
        self.op_fields = [BY_NAME[op].field for op in ops]  # the field each op is read from
        self.norm = "norm" in ops
        self.minmax = "min" in ops or "max" in ops
        self.zeros = "zeros" in ops
        self.flags = "nans" in ops or "infs" in ops
        # the sum gives the mean, and is the NaN/Inf witness when min/max are not computed
        self.total = "mean" in ops or (self.flags and not self.minmax)
        self.per_element = [BY_NAME[op].per_element for op in ops]
        self.scaled = any(self.per_element)
        self.fields = [
            name
            for name, wanted in (
                ("norm", self.norm),
                ("min", self.minmax),
                ("max", self.minmax),
                ("sum", self.total),
                ("zeros", self.zeros),
            )
            if wanted
        ]

        self.native_columns = [FIELDS.index(field) for field in self.op_fields]  # the kernel's field indices
        self.unscaled = [False] * len(ops)

    @functools.cached_property
    def without_norm(self) -> _Plan:
        """The same reductions but the norm (computed for a whole batch in one call)."""
        return _Plan(tuple(op for op in self.ops if op != "norm"))


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
            view = self.views[key] = buf[: t.numel()].view(t.shape)
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
    if t.device.type == "cpu" and t.numel() > CHUNK and t.is_contiguous():
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
    batch_norm = plan.norm and not any(t.device.type == "cpu" and t.numel() > CHUNK for t in ts)
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


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built tensor on the device; from pinned memory the copy is asynchronous."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


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
    for op, test in (("nans", torch.isnan), ("infs", torch.isinf)):
        if op not in plan.ops:
            continue
        if clean is True:
            columns[op] = _zeros(n)
        else:
            flags = clean if isinstance(clean, list) else [False] * n
            columns[op] = torch.stack([_ZERO if ok else test(t).sum().to(RESULT_DTYPE) for t, ok in zip(ts, flags)])


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
    acc = _accumulate_dtype(t.dtype)
    values = _one(t, plan, zero_threshold(eps, t.dtype) if plan.zeros else 0.0, acc)
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


def _native_rows(
    ts: list[torch.Tensor], plan: _Plan, eps: float, flat: bool = False, scaled: bool = True
) -> torch.Tensor | None:
    """Rows from one call of the native kernel (msmon.native), or None when it is not built or
    cannot read every tensor (they then take the torch path together). The tensors must share
    a dtype (one zero threshold) and be plain tensors (not DTensors). `scaled`: mean and zero
    fraction divided by the element count, as returned to callers; otherwise sums and counts."""
    rows_of = native.readable_rows()  # checks every tensor (native.eligible) while packing the call
    if rows_of is None:
        return None
    return rows_of(
        ts,
        zero_threshold(eps, ts[0].dtype) if plan.zeros else 0.0,
        plan.native_columns,
        plan.per_element if scaled else plan.unscaled,
        flat,
        (_threads or configure_threads()).native or torch.get_num_threads(),
        native.share_elements(),
    )


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class Threads:
    """How many threads the statistics use on the CPU (0: torch's own setting)."""

    stats: int  # MSMON_STAT_THREADS (default 1): the torch reductions; see _cpu_threads
    native: int  # MSMON_NATIVE_THREADS (default 0): the threads that may share one native call


_threads: Threads | None = None


def configure_threads() -> Threads:
    """Read MSMON_STAT_THREADS and MSMON_NATIVE_THREADS from the environment now (the monitor
    does at attach; statistics asked for before that read them at their first call)."""
    global _threads
    _threads = Threads(
        stats=int(os.environ.get("MSMON_STAT_THREADS", "1") or 0),
        native=int(os.environ.get("MSMON_NATIVE_THREADS", "0") or 0),
    )
    return _threads


def _batch_rows(ts: list[torch.Tensor], plan: _Plan, eps: float) -> torch.Tensor:
    """Unscaled [n, ops] rows of tensors sharing one device and dtype."""
    rows = _native_rows(ts, plan, eps, scaled=False)  # on the training's thread count, not _cpu_threads'
    if rows is not None:
        return rows
    acc = _accumulate_dtype(ts[0].dtype)
    with _cpu_threads(ts[0].device):
        columns, positions = _columns(ts, plan, zero_threshold(eps, ts[0].dtype) if plan.zeros else 0.0, acc)
        if plan.flags:
            _count_columns(ts if positions is None else [ts[i] for i in positions], columns, plan)
    if plan.zeros and any(t.numel() > _EXACT_F32_COUNT for t in ts):
        columns["zeros"] = columns["zeros"].to(RESULT_DTYPE)
    rows = torch.stack([columns[field] for field in plan.op_fields], dim=1)
    if positions is not None:
        rows = rows.index_select(0, _inverse(tuple(positions), rows.device))
    return rows


@functools.lru_cache(maxsize=64)
def _inverse(positions: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The permutation that puts rows computed in `positions` order back in input order."""
    inverse = [0] * len(positions)
    for row, position in enumerate(positions):
        inverse[position] = row
    return _to_device(torch.tensor(inverse, dtype=torch.long), device)


@functools.lru_cache(maxsize=512)
def _divisors(numels: tuple[int, ...], ops: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """[rows, ops] float64 divisors: the element count for per-element ops, 1 elsewhere."""
    values = [[float(n) if BY_NAME[op].per_element else 1.0 for op in ops] for n in numels]
    return _to_device(torch.tensor(values, dtype=RESULT_DTYPE), device)


def _scaled(rows: torch.Tensor, numels: list[int], plan: _Plan) -> torch.Tensor:
    """[n, ops] unscaled rows to the float64 result: means and zero fractions divided by numel."""
    rows = rows.to(RESULT_DTYPE)
    if plan.scaled:
        rows = rows / _divisors(tuple(numels), plan.ops, rows.device)
    return rows


class _cpu_threads:
    """Run the CPU reductions on Threads.stats threads. Every parallel region costs a fork and
    a join of torch's thread pool; on a machine whose cores the training already keeps busy
    (and whose writer thread, data loader or neighbours take a core now and then) each join
    can wait for a preempted thread. The statistics are many short reductions, so they pay
    that far more often than the training does. Restored on exit (set_num_threads: 0.3 us)."""

    __slots__ = ("before", "threads")

    def __init__(self, device: torch.device) -> None:
        self.threads = (_threads or configure_threads()).stats
        self.before = torch.get_num_threads() if device.type == "cpu" and self.threads else 0

    def __enter__(self) -> None:
        if self.before and self.before != self.threads:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc) -> None:
        if self.before and self.before != self.threads:
            torch.set_num_threads(self.before)


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
    numels = [t.numel() for t in prepared]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(prepared):
        if numels[i]:
            groups[(t.device, t.dtype)].append(i)
    if len(groups) == 1 and all(numels) and next(iter(groups))[0] == device:
        return _scaled(_batch_rows(prepared, plan, eps), numels, plan)
    out = _nan_rows(len(prepared), plan, device)
    for (dev, _), indices in groups.items():
        rows = _scaled(_batch_rows([prepared[i] for i in indices], plan, eps), [numels[i] for i in indices], plan)
        out[torch.tensor(indices, device=device)] = rows.to(device, non_blocking=True)
    return out


def tensor_stats(tensor: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """Statistics of one tensor: a [len(ops)] float64 tensor on its device."""
    plan = _plan(tuple(ops))
    if type(tensor) in _PLAIN_TYPES:  # no DTensor to unwrap; the kernel reads data, not autograd
        row = _native_rows([tensor], plan, eps, flat=True)
        if row is not None:
            return row
    t = _as_stat_input(tensor)
    if t.numel() == 0:
        return _nan_rows(1, plan, t.device).view(-1)
    if not tensor.is_floating_point() and type(t) is torch.Tensor:
        # integers as exact floats (a model's token ids): the kernel reads those too, and the
        # reductions below would be kernels that nothing else in the training runs
        row = _native_rows([t], plan, eps, flat=True)
        if row is not None:
            return row
    with _cpu_threads(t.device):
        return _scaled(torch.stack(_row_values(t, plan, eps)).view(1, -1), [t.numel()], plan).view(-1)


class _OverAll:
    """Reductions over every element: the pieces of one tensor, a [pieces] column."""

    sum = staticmethod(torch.Tensor.sum)
    min = staticmethod(torch.Tensor.min)
    max = staticmethod(torch.Tensor.max)


class _OverRanks:
    """Reductions along dim 0: the ranks' pieces of many tensors, a [ranks, tensors] column."""

    @staticmethod
    def sum(x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)

    @staticmethod
    def min(x: torch.Tensor) -> torch.Tensor:
        return x.amin(0)

    @staticmethod
    def max(x: torch.Tensor) -> torch.Tensor:
        return x.amax(0)


def combine_rows(rows: torch.Tensor, counts: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """Exact statistics of a tensor from the statistics of its disjoint pieces.

    rows: [pieces, ops] statistics of each piece; counts: [pieces] element counts. Each op
    combines by its rule (msmon.ops): norms add in squares, min of mins, max of maxes, means
    weighted by count, zero counts recovered from each fraction (so the combined fraction is
    exactly the directly computed one), nan and inf counts add up. Empty pieces (count 0, NaN
    rows) are left out; if every piece is empty the result is a NaN row, like the statistics of
    an empty tensor. No host sync.
    """
    counts = counts.to(device=rows.device, dtype=rows.dtype)
    keep = counts > 0
    total = counts.sum()
    columns = [BY_NAME[op].combine(_OverAll, rows[:, j], counts, keep, total) for j, op in enumerate(ops)]
    return torch.where(total > 0, torch.stack(columns), math.nan)


def combine_gathered(rows: torch.Tensor, counts: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """combine_rows for many tensors at once: [ranks, tensors, ops] piece statistics with
    [ranks, tensors] element counts give [tensors, ops] statistics of the whole tensors."""
    counts = counts.to(rows.dtype)
    keep = counts > 0
    total = counts.sum(0)
    columns = [BY_NAME[op].combine(_OverRanks, rows[..., j], counts, keep, total) for j, op in enumerate(ops)]
    return torch.where((total > 0).unsqueeze(-1), torch.stack(columns, dim=-1), math.nan)


# -- mg_direction: how many elements of a gradient point the way of its momentum ----------------
_SIGN_CHUNK = 1 << 22  # elements per pass on accelerators: bounds the temporaries (16 MiB of float32 each)


def _sign_mismatch(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count of elements with sign(g) != sign(m), whether either holds a NaN) of two flat
    tensors of one size, as 0-d tensors; one temporary pair per chunk. torch.sign(NaN) is 0,
    so NaNs are looked for apart, in the maxima."""
    chunk = CHUNK if g.device.type == "cpu" else _SIGN_CHUNK
    counts, nans = [], []
    for start in range(0, g.numel(), chunk):
        gc, mc = g[start : start + chunk], m[start : start + chunk]
        d = torch.sign(gc)
        d.sub_(torch.sign(mc)).abs_().clamp_(max=1)  # 1 where the signs differ (count_nonzero: 4x slower)
        counts.append(d.sum(dtype=torch.float32))  # exact: a chunk holds fewer than 2**24 elements
        nans.append(torch.amax(gc))  # max propagates NaN (and only NaN): a cheap reduction, not isnan().any()
        nans.append(torch.amax(mc))
    return torch.stack(counts).sum().to(RESULT_DTYPE), torch.isnan(torch.stack(nans)).any()


def _matches(numel: int, mismatch: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    return torch.where(nan, math.nan, numel - mismatch)


def sign_matches(grads: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> torch.Tensor:
    """[n] float64 counts of the elements where sign(grad) == sign(moment) (zero equals zero),
    pair by pair, on the first gradient's device without host sync. A pair holding a NaN, or
    of unequal sizes, counts NaN. Small pairs of one device and dtype are compared in one pass over a flat copy
    (as batch_stats does), larger ones tensor by tensor in bounded chunks."""
    if not grads:
        return torch.empty(0, dtype=RESULT_DTYPE)
    pairs = [(_as_stat_input(g).reshape(-1), _as_stat_input(m).reshape(-1)) for g, m in zip(grads, moments)]
    device = pairs[0][0].device
    out: list[torch.Tensor | None] = [None] * len(pairs)
    small: dict[tuple, list[int]] = defaultdict(list)
    for i, (g, m) in enumerate(pairs):
        if g.numel() != m.numel() or g.device != m.device:
            out[i] = torch.tensor(math.nan, dtype=RESULT_DTYPE, device=device)
        elif g.numel() == 0:
            out[i] = torch.zeros((), dtype=RESULT_DTYPE, device=device)
        elif g.numel() <= SMALL:
            small[(g.device, g.dtype, m.dtype)].append(i)
        else:
            out[i] = _matches(g.numel(), *_sign_mismatch(g, m)).to(device)
    with _cpu_threads(device):
        for (dev, _, _), indices in small.items():
            if len(indices) < _MIN_SEGMENTS:
                for i in indices:
                    out[i] = _matches(pairs[i][0].numel(), *_sign_mismatch(*pairs[i])).to(device)
                continue
            flat_g = torch.cat([pairs[i][0] for i in indices])
            flat_m = torch.cat([pairs[i][1] for i in indices])
            numels = tuple(pairs[i][0].numel() for i in indices)
            lengths, _ = _layout(numels, dev)
            d = torch.sign(flat_g)
            d.sub_(torch.sign(flat_m)).abs_().clamp_(max=1)
            mismatch = torch.segment_reduce(d.to(torch.float32), "sum", lengths=lengths)
            nans = torch.isnan(torch.segment_reduce(flat_g.to(torch.float32), "max", lengths=lengths)) | torch.isnan(
                torch.segment_reduce(flat_m.to(torch.float32), "max", lengths=lengths)
            )
            sizes = _to_device(torch.tensor(numels, dtype=RESULT_DTYPE), dev)
            counts = torch.where(nans, math.nan, sizes - mismatch.to(RESULT_DTYPE)).to(device)
            for j, i in enumerate(indices):
                out[i] = counts[j]
    return torch.stack([cast(torch.Tensor, t).to(device) for t in out])  # every entry is set above


def scalar_rows(values: torch.Tensor, ops: Sequence[str], eps: float) -> torch.Tensor:
    """[n, ops] statistics of n scalars, each taken as a one-element tensor (what msprobe's ops
    give for mg_direction): norm |x|, min = max = mean = x, zeros 1 or 0, nans and infs 0 or 1."""
    x = values.to(RESULT_DTYPE)
    columns = []
    for op in ops:
        if op == "norm":
            columns.append(x.abs())
        elif op in ("min", "max", "mean"):
            columns.append(x)
        elif op == "zeros":
            columns.append((x.abs() < eps).to(RESULT_DTYPE))
        elif op == "nans":
            columns.append(torch.isnan(x).to(RESULT_DTYPE))
        elif op == "infs":
            columns.append(torch.isinf(x).to(RESULT_DTYPE))
        else:
            raise ValueError(unknown(op))
    return torch.stack(columns, dim=1) if columns else x.new_empty((x.numel(), 0))

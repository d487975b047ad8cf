"""Statistics of tensors, computed on the tensors' own device without any host sync.

The result of every function here is a float64 tensor on the input's device, one row per
tensor and one column per op in the order asked for:

- norm: L2 norm, accumulated in float32 (float64 for float64 input);
- min, max: exact; mean: the sum (accumulated like the norm) divided by the element count;
- zeros: the fraction of elements with |x| < eps, compared exactly (as real numbers, so a
  float16 tensor counts its zeros even though eps=1e-8 is below float16's resolution);
- nans, infs: exact counts.

Where the native kernel is loaded (msmon.stats.native: built at the first attach where a C++
compiler is found, or by `msmon build-native`), plain contiguous float32/float64 CPU tensors
are read once for all ops, a whole batch per call, and the finished rows come back from it;
everything else takes the torch path: on the CPU msmon.stats.reductions, on accelerators (and
on the CPU with MSMON_DEVICE_PATH=1) msmon.stats.multi_tensor, whose number of kernels does not
grow with the number of tensors in a batch.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from . import fused_rows, multi_tensor, native, threads
from .device_path import host_code
from .inputs import RESULT_DTYPE, _as_stat_input, _to_device, zero_threshold
from .plan import _Plan, _plan
from .reductions import _EXACT_F32_COUNT, _columns, _count_columns, _own_columns, _row_values
from .threads import _cpu_threads


def _native_rows(
    ts: list[torch.Tensor], plan: _Plan, eps: float, flat: bool = False, scaled: bool = True
) -> torch.Tensor | None:
    """Rows from one call of the native kernel (msmon.stats.native), or None when it is not built or
    cannot read every tensor (they then take the torch path together). The tensors must share
    a dtype (one zero threshold) and be plain tensors (not DTensors). `scaled`: mean and zero
    fraction divided by the element count, as returned to callers; otherwise sums and counts."""
    if plan.native_columns is None:  # an op the kernel does not compute (msmon.stats.ops: Op.native)
        return None
    kernel = native.stats_kernel()
    if kernel is None:
        return None
    return kernel.readable_rows(  # checks every tensor (native.eligible) while packing the call
        ts,
        zero_threshold(eps, ts[0].dtype) if plan.zeros else 0.0,
        plan.native_columns,
        plan.per_element if scaled else plan.unscaled,
        flat,
        threads.current().native or torch.get_num_threads(),
        kernel.min_share,
        bool(plan.derived),
    )


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _batch_rows(ts: list[torch.Tensor], plan: _Plan, eps: float) -> torch.Tensor:
    """Unscaled [n, ops] rows of tensors sharing one device and dtype."""
    rows = _native_rows(ts, plan, eps, scaled=False)  # on the training's thread count, not _cpu_threads'
    if rows is not None:
        return rows
    threshold = zero_threshold(eps, ts[0].dtype) if plan.zeros else 0.0
    # the accelerators' path, launches flat in the tensor count; a tensor subclass (whose storage
    # and views may not be plain memory) takes the per-tensor reductions below
    if not host_code(ts[0].device) and all(type(t) in _PLAIN_TYPES for t in ts):
        return _accelerator_rows(ts, plan, threshold)
    return _torch_rows(ts, plan, threshold)


# On the accelerator path a tensor over this many elements is read by the per-tensor reductions:
# the multi-tensor route makes about four more passes over memory than they do to save their
# launches (~8 ops of 10-20 us of host time each), and from about 16 M elements (64 MiB of
# float32: four passes at 3 TB/s take ~80 us) the passes cost more than the launches saved
# (the compiled pass, msmon.stats.fused_rows, reads every element once: there no tensor is too large)
PER_TENSOR_MIN = 1 << 24


def _accelerator_rows(ts: list[torch.Tensor], plan: _Plan, threshold: float) -> torch.Tensor:
    """Unscaled float64 rows on the accelerator path: the batch in a fixed number of kernels
    (msmon.stats.multi_tensor), but, where the `_foreach_*` route runs, its largest tensors one
    by one (PER_TENSOR_MIN)."""
    if fused_rows.usable(ts[0].device):
        # one parallel region per chunk, like the native kernel: on the training's thread count
        return multi_tensor.batch_columns(ts, plan, threshold)
    large = [i for i, t in enumerate(ts) if t.numel() > PER_TENSOR_MIN]
    if not large:
        with _cpu_threads(ts[0].device):
            return multi_tensor.batch_columns(ts, plan, threshold)
    if len(large) == len(ts):
        return _torch_rows(ts, plan, threshold).to(RESULT_DTYPE)
    taken = set(large)
    small = [i for i in range(len(ts)) if i not in taken]
    with _cpu_threads(ts[0].device):
        first = multi_tensor.batch_columns([ts[i] for i in small], plan, threshold)
    second = _torch_rows([ts[i] for i in large], plan, threshold).to(RESULT_DTYPE)
    rows = torch.cat([first, second.to(first.device)])
    return rows.index_select(0, _inverse(tuple(small + large), rows.device))


def _torch_rows(ts: list[torch.Tensor], plan: _Plan, threshold: float) -> torch.Tensor:
    """Unscaled [n, ops] rows by the per-tensor torch reductions (msmon.stats.reductions)."""
    acc = plan.accumulate(ts[0].dtype)
    with _cpu_threads(ts[0].device):
        columns, positions = _columns(ts, plan, threshold, acc)
        if plan.flags:
            _count_columns(ts if positions is None else [ts[i] for i in positions], columns, plan)
        if plan.own:
            _own_columns(ts if positions is None else [ts[i] for i in positions], columns, plan, acc)
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
def _divisors(numels: tuple[int, ...], per_element: tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """[rows, ops] float64 divisors: the element count for per-element ops, 1 elsewhere."""
    values = [[float(n) if divided else 1.0 for divided in per_element] for n in numels]
    return _to_device(torch.tensor(values, dtype=RESULT_DTYPE), device)


@functools.lru_cache(maxsize=512)
def _counts(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[rows] float64 element counts (what a derived op is derived with)."""
    return _to_device(torch.tensor(numels, dtype=RESULT_DTYPE), device)


def _derived(rows: torch.Tensor, numels: list[int], plan: _Plan) -> torch.Tensor:
    """Scaled [n, computed] rows to the [n, ops] result (the plan's derived ops filled in)."""
    if not plan.derived and not plan.narrowed:
        return rows
    return plan.finish(rows, _counts(tuple(numels), rows.device))


def _scaled(rows: torch.Tensor, numels: list[int], plan: _Plan) -> torch.Tensor:
    """[n, computed] unscaled rows to the float64 result: means and zero fractions divided by
    numel, derived ops filled in."""
    rows = rows.to(RESULT_DTYPE)
    if plan.scaled:
        rows = rows / _divisors(tuple(numels), plan.divisor_key, rows.device)
    return _derived(rows, numels, plan)


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
            return _derived(row.view(1, -1), [tensor.numel()], plan).view(-1) if plan.derived else row
    t = _as_stat_input(tensor)
    if t.numel() == 0:
        return _nan_rows(1, plan, t.device).view(-1)
    if not tensor.is_floating_point() and type(t) is torch.Tensor:
        # integers as exact floats (a model's token ids): the kernel reads those too, and the
        # reductions below would be kernels that nothing else in the training runs
        row = _native_rows([t], plan, eps, flat=True)
        if row is not None:
            return _derived(row.view(1, -1), [t.numel()], plan).view(-1) if plan.derived else row
    with _cpu_threads(t.device):
        return _scaled(torch.stack(_row_values(t, plan, eps)).view(1, -1), [t.numel()], plan).view(-1)

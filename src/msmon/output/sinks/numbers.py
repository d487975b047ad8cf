"""How a statistic reads in a CSV cell: `repr(csv_value(v, ndigits))`.

msprobe writes `round(v, ndigits)`: fixed decimals, so a small non-zero value (Adam's
exp_avg_sq is often 1e-10) reads 0.0. Here a magnitude of 1 or more keeps exactly that
format, and one below 1 keeps `ndigits` significant digits instead (repr switches to
scientific notation below 1e-4), so no non-zero value reads 0. Between 0.1 and 1 both rules
give the same digits.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

from ...records.csv_cell import csv_value
from ...stats import native

_EXACT_POWERS = 22  # 10.0**k is exact up to here, so M / 10**k is the correctly rounded M·10⁻ᵏ
_POW10 = torch.tensor([float(10**k) for k in range(_EXACT_POWERS + 1)], dtype=torch.float64)
# 1e-323 ... 1e0: the decimal exponent of a magnitude below 1 by search, not by log10, which
# MKL computes in an OpenMP team of the calling thread's own (msmon.system.torch_threads)
_LOWEST = 323
_DECADES = torch.tensor([10.0**-k for k in range(_LOWEST, -1, -1)], dtype=torch.float64)


def csv_values(table: torch.Tensor, ndigits: int) -> list[list[float]]:
    """`[[csv_value(v, ndigits) for v in row] for row in table.tolist()]` for a 2-D float64
    table (csv_flat's values, a list per row)."""
    width = table.shape[1]
    flat = csv_flat(table, ndigits)
    return [flat[i : i + width] for i in range(0, len(flat), width)]


def csv_flat(table: torch.Tensor, ndigits: int) -> list[float]:
    """`[csv_value(v, ndigits) for v in table.view(-1).tolist()]` for a 2-D float64 table,
    vectorised and as one flat list (no list per row for the garbage collector): the writer
    thread formats every value of every step, and on a machine with few cores its CPU time is
    taken from the training.

    Each value keeps k decimals (ndigits, or for |v| < 1 enough for ndigits significant
    digits): round(v·10ᵏ) / 10ᵏ is the double Python's formatting gives unless the scaled
    product was inexact right at a tie, the power of ten is not exact (k > 22), the product
    is too large to round in a double, or the exponent search misjudged the first digit. Those values (and
    non-finite ones) are formatted by `csv_value` itself, so the result is identical.

    The native kernel computes it where it is loaded (msmon.stats.native: the same float64
    operations, so the same doubles); torch ops otherwise. The kernel is preferred for memory,
    not time: the twenty-odd torch kernels below are code that nothing else in a training
    process runs, and touching it made about 1.2 MiB of libtorch resident (docs/performance.md).
    """
    rounding = native.csv_rounding()
    if rounding is not None and table.dtype == torch.float64 and table.is_cpu and table.is_contiguous():
        return _rounded_by_kernel(rounding, table, ndigits)
    return _rounded_by_torch(table, ndigits)


def csv_table(table: torch.Tensor, ndigits: int) -> torch.Tensor:
    """csv_flat's values as a new float64 tensor of the table's shape, for a columnar sink
    (parquet) that keeps the CSV's values without a Python float per value."""
    table = table.to(torch.float64).contiguous()
    rounding = native.csv_rounding()
    if rounding is not None and table.is_cpu:
        out = torch.empty_like(table)
        n = table.numel()
        left = (ctypes.c_int64 * n)()
        count = rounding(table.data_ptr(), out.data_ptr(), n, ndigits, _DECADES.data_ptr(), ctypes.addressof(left))
        flat = out.view(-1)
        for i in left[:count]:  # the kernel left these values as they were
            flat[i] = csv_value(float(flat[i]), ndigits)
        return out
    rounded, doubtful = _rounded_tensor(table, ndigits)
    if doubtful.any():
        flat, values = rounded.view(-1), table.reshape(-1)
        for i in doubtful.view(-1).nonzero().view(-1).tolist():
            flat[i] = csv_value(float(values[i]), ndigits)
    return rounded


def _rounded_by_kernel(rounding: Callable[..., int], table: torch.Tensor, ndigits: int) -> list[float]:
    n = table.numel()
    out = (ctypes.c_double * n)()
    doubtful = (ctypes.c_int64 * n)()
    count = rounding(
        table.data_ptr(), ctypes.addressof(out), n, ndigits, _DECADES.data_ptr(), ctypes.addressof(doubtful)
    )
    flat = out[:]
    for i in doubtful[:count]:  # the kernel left these values as they were
        flat[i] = csv_value(flat[i], ndigits)
    return flat


def _rounded_by_torch(table: torch.Tensor, ndigits: int) -> list[float]:
    rounded, doubtful = _rounded_tensor(table, ndigits)
    flat = rounded.view(-1).tolist()
    if doubtful.any():
        values = table.reshape(-1)
        for i in doubtful.view(-1).nonzero().view(-1).tolist():
            flat[i] = csv_value(float(values[i]), ndigits)
    return flat


def _rounded_tensor(table: torch.Tensor, ndigits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(round(v·10ᵏ) / 10ᵏ of every value, where that may differ from csv_value's double)."""
    digits = max(ndigits, 1)
    magnitude = table.abs()
    small = (magnitude < 1.0) & (magnitude > 0.0)
    below_one = torch.where(small, magnitude, torch.ones_like(magnitude))
    exponent = (torch.bucketize(below_one, _DECADES, right=True) - (_LOWEST + 1)).to(table.dtype)
    decimals = torch.where(small, digits - 1 - exponent, torch.full_like(exponent, float(ndigits)))
    scale = _POW10[decimals.clamp(0, _EXACT_POWERS).long()]
    scaled = table * scale
    kept = torch.round(scaled)
    size = scaled.abs()
    doubtful = (
        ((scaled - torch.floor(scaled) - 0.5).abs() <= size * 2.0**-48) | ~(size < 2.0**52) | (decimals > _EXACT_POWERS)
    )
    first_digit_wrong = (kept.abs() < float(10 ** (digits - 1))) | (kept.abs() > float(10**digits))
    doubtful |= small & first_digit_wrong
    return kept / scale, doubtful

"""What a statistic reads: the rank-local data of a tensor, as floating point, and the
dtype-dependent constants of its reductions (accumulation dtype, the exact zero threshold)."""

from __future__ import annotations

import functools
import math
import struct

import torch

RESULT_DTYPE = torch.float64


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


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built tensor on the device; from pinned memory the copy is asynchronous."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=512)
def indices_on_device(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A host-known index or length list on the device, built once per layout (cached: no copy
    to the device in a repeated step)."""
    return _to_device(torch.tensor(values, dtype=torch.long), device)

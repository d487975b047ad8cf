"""Optional one-pass CPU statistics, built on first use (MSMON_NATIVE_STATS=1).

On the CPU, msmon's statistics are torch reductions, one pass over the tensor per op. This
extension reads a contiguous float32/float64 tensor once for all of them, which halves the
monitor's CPU time (docs/performance.md). It is off by default because it needs a C++
compiler and ninja on the training machine: it is compiled by torch.utils.cpp_extension the
first time a monitor attaches (about a minute, cached in TORCH_EXTENSIONS_DIR after that).
Portable flags only: the cache may be shared by nodes with different CPUs. If the build
fails, the reason is logged once and the torch reductions are used.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("msmon")

ENV = "MSMON_NATIVE_STATS"
_NAME = "msmon_fused_stats_v3"  # a new name for every change of the source: the cache is keyed on it
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_stats.cpp")

FusedStats = Callable[[torch.Tensor, float], torch.Tensor]
FusedStatsMany = Callable[[list, float], torch.Tensor]

_lock = threading.Lock()
_loaded: Any = None  # the extension module once built
_tried = False


def requested() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _module() -> Any:
    if _loaded is not None or _tried:
        return _loaded
    return load() if requested() else None


def fused_stats() -> Optional[FusedStats]:
    """[norm, min, max, sum, zeros, nans, infs] of one tensor when requested and built; None
    otherwise (use torch)."""
    module = _module()
    return None if module is None else module.fused_stats


def fused_stats_many() -> Optional[FusedStatsMany]:
    """The same for a list of tensors in one call, a [n, 7] row per tensor; None when not built."""
    module = _module()
    return None if module is None else module.fused_stats_many


def stats_rows() -> Optional[Callable[..., torch.Tensor]]:
    """`stats_rows(tensors, threshold, columns, per_element, flat)`: finished rows in the
    caller's column order (fields divided by the element count where asked); None when not built."""
    module = _module()
    return None if module is None else module.stats_rows


def isa() -> Optional[str]:
    """The instruction set the kernel's loop uses here ("avx2" or "baseline"); None when not built."""
    module = _module()
    return None if module is None else module.isa()


def load() -> Any:
    """Build (or load from the cache) the extension; log once and return None on failure."""
    global _loaded, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        try:
            from torch.utils.cpp_extension import load as build

            module = build(name=_NAME, sources=[_SOURCE], extra_cflags=["-O3", "-fopenmp-simd"], verbose=False)
            _loaded = module
        except Exception as exc:  # a missing compiler or ninja must never stop training
            logger.warning("msmon: %s=1 but the native statistics could not be built (%s: %s); using torch "
                           "reductions", ENV, type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc) else "")
        return _loaded


_READABLE = (torch.float32, torch.float64)


def eligible(t: torch.Tensor) -> bool:
    """Tensors the kernel reads directly: contiguous, on the CPU, float32 or float64, not empty."""
    return t.dtype in _READABLE and t.is_cpu and t.is_contiguous() and t.numel() > 0

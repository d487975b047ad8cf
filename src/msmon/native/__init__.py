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
from typing import Callable, Optional

import torch

logger = logging.getLogger("msmon")

ENV = "MSMON_NATIVE_STATS"
_NAME = "msmon_fused_stats_v1"  # a new name for every change of the source: the cache is keyed on it
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_stats.cpp")

FusedStats = Callable[[torch.Tensor, float], torch.Tensor]

_lock = threading.Lock()
_loaded: Optional[FusedStats] = None
_tried = False


def requested() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def fused_stats() -> Optional[FusedStats]:
    """The native function when requested and built; None otherwise (use torch)."""
    if _loaded is not None or _tried:
        return _loaded
    return load() if requested() else None


def load() -> Optional[FusedStats]:
    """Build (or load from the cache) the extension; log once and return None on failure."""
    global _loaded, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        try:
            from torch.utils.cpp_extension import load as build

            module = build(name=_NAME, sources=[_SOURCE], extra_cflags=["-O3", "-fopenmp-simd"], verbose=False)
            _loaded = module.fused_stats
        except Exception as exc:  # a missing compiler or ninja must never stop training
            logger.warning("msmon: %s=1 but the native statistics could not be built (%s: %s); using torch "
                           "reductions", ENV, type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc) else "")
        return _loaded


def eligible(t: torch.Tensor) -> bool:
    """Tensors the kernel reads directly: contiguous, on the CPU, float32 or float64, not empty."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and t.is_contiguous() and t.numel() > 0

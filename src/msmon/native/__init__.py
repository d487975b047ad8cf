"""One-pass CPU statistics from a small C++ kernel, used whenever it has been built.

On the CPU, msmon's statistics are torch reductions, one pass over the tensor per op. This
extension reads a contiguous float32/float64 tensor once for all of them, a whole batch per
call, which cuts the monitor's CPU time by a half to two thirds (docs/performance.md).

It needs a C++ compiler and ninja, so it is never built behind the user's back in the middle
of a job. MSMON_NATIVE_STATS decides:

- unset or `auto` (the default): use the kernel if it was already built for this source and
  this torch (`msmon build-native`, which `make` runs); otherwise the torch reductions;
- `1`: build it at the first attach if needed (about a minute, cached in TORCH_EXTENSIONS_DIR);
- `0`: never use it.

The build uses portable flags (the AVX2 loop is chosen at run time), since the cache may be
shared by nodes with different CPUs. A failed build or load is logged once and the torch
reductions are used.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import sys
import threading
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("msmon")

ENV = "MSMON_NATIVE_STATS"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_stats.cpp")
_CFLAGS = ["-O3", "-fopenmp-simd"]


_lock = threading.Lock()
_loaded: Any = None  # the extension module once built or found
_tried = False


def _extension_name() -> str:
    """Keyed on the source and the torch version: a build is only ever reused for both."""
    with open(_SOURCE, "rb") as fh:
        digest = hashlib.sha1(fh.read() + " ".join(_CFLAGS).encode()).hexdigest()[:12]
    return f"msmon_stats_{digest}_torch{re.sub(r'[^0-9A-Za-z]', '_', torch.__version__)}"


_NAME = _extension_name()


def mode() -> str:
    """"build", "off" or "auto", from MSMON_NATIVE_STATS."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on", "build"):
        return "build"
    if value in ("0", "false", "no", "off"):
        return "off"
    return "auto"


def requested() -> bool:
    """Whether the kernel should be built if it is not there yet (MSMON_NATIVE_STATS=1)."""
    return mode() == "build"


def built_path() -> str:
    """Where torch's cpp_extension puts the compiled extension (its build-directory rule),
    worked out here without importing cpp_extension, which pulls in setuptools and distutils
    (4 MiB of resident memory in every rank) and without creating the directory."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch._appdirs

        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accelerator}")
    return os.path.join(root, _NAME, f"{_NAME}.so")


def _module() -> Any:
    if _loaded is not None or _tried:
        return _loaded
    current = mode()
    if current == "build":
        return load()
    if current == "auto":
        return load_built()
    return None


def prepare() -> None:
    """Find (or, with MSMON_NATIVE_STATS=1, build) the kernel now, at attach, not in a hook."""
    _module()


def load_built() -> Any:
    """Import the extension if a build for this source and torch exists; never compile."""
    global _loaded, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        try:
            path = built_path()
            if os.path.exists(path):
                spec = importlib.util.spec_from_file_location(_NAME, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _loaded = module
        except Exception as exc:  # a broken cache must never stop training
            logger.warning("msmon: the built native statistics could not be loaded (%s: %s); using torch reductions",
                           type(exc).__name__, exc)
        return _loaded


def stats_rows() -> Optional[Callable[..., torch.Tensor]]:
    """`stats_rows(tensors, threshold, columns, per_element, flat, threads, min_share)`: finished
    rows in the caller's column order (fields divided by the element count where asked), read by
    up to `threads` threads of at least `min_share` elements each; None when not built."""
    module = _module()
    return None if module is None else module.stats_rows


def isa() -> Optional[str]:
    """The instruction set the kernel's loop uses here ("avx2" or "baseline"); None when not built."""
    module = _module()
    return None if module is None else module.isa()


def load() -> Any:
    """Build (or load from the cache) the extension; log once and return None on failure.
    With MSMON_NATIVE_STATS=0 nothing is built."""
    global _loaded, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if mode() == "off":
            return None
        try:
            from torch.utils.cpp_extension import load as build

            module = build(name=_NAME, sources=[_SOURCE], extra_cflags=_CFLAGS, verbose=False)
            _loaded = module
        except Exception as exc:  # a missing compiler or ninja must never stop training
            logger.warning("msmon: %s=1 but the native statistics could not be built (%s: %s); using torch "
                           "reductions", ENV, type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc) else "")
        return _loaded


_READABLE = (torch.float32, torch.float64)


def eligible(t: torch.Tensor) -> bool:
    """Tensors the kernel reads directly: contiguous, on the CPU, float32 or float64, not empty."""
    return t.dtype in _READABLE and t.is_cpu and t.is_contiguous() and t.numel() > 0

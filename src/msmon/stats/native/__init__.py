"""One-pass CPU statistics from a small C++ kernel, built on first use.

On the CPU, msmon's statistics are torch reductions, one pass over the tensor per op. The
kernel (fused_stats.cpp) reads a contiguous float32/float64 tensor once for all of them, a
whole batch per call, which cuts the monitor's CPU time by a half to two thirds
(docs/performance.md). It is plain C++ behind a C ABI, loaded with ctypes: no torch headers,
no ninja, a second or two of one compiler call (native/build.py), cached per user and keyed on
the source, the flags and the compiler, so it survives torch upgrades.

The same library rounds the CSV sink's values (`csv_rounding()`, msmon.output.sinks.numbers): in torch
ops that rounding made libtorch code resident that nothing else in a training process runs.

MSMON_NATIVE_STATS decides:

- unset or `auto` (the default): at attach (`prepare()`, never inside a hook) the kernel is
  loaded from the cache or built there if a C++ compiler is found; without one, one log line
  and torch reductions;
- `1`: the same, but a failure is logged as an error;
- `0`: never used.

`msmon build-native` builds it ahead of time. The cache is $MSMON_CACHE_DIR, else
$XDG_CACHE_HOME/msmon, else ~/.cache/msmon; ranks starting together build it once (a file
lock). Statistics asked for before any attach only use a build that already exists.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch

from ...system.torch_threads import training_team
from .. import device_path
from ..ops import FIELDS
from . import build

logger = logging.getLogger("msmon")

ENV = "MSMON_NATIVE_STATS"
TEAM_ENV = "MSMON_NATIVE_TEAM"  # "0": large calls are shared by threads of the kernel's own
_ABI = 4  # fused_stats.cpp's msmon_stats_abi()
_FIELDS = len(FIELDS)  # the fields it computes, in its order: the op table's FIELDS
_ERRORS = {
    1: "out of memory or no thread to start",
    2: f"a column is a field index 0..{_FIELDS - 1}",
    3: "an input is empty, null or not float32/float64",
    4: "a negative count or no output",
}

_lock = threading.Lock()
_loaded: Any = None  # the _Kernel once loaded
# False: nothing tried; "looked": an existing build was looked for (outside an attach, which
# never compiles); True: the full attempt was made (prepare, load)
_tried: Union[bool, str] = False
compiled_here = False  # whether this process compiled the kernel (tests, benchmarks, build-native)
build_seconds = 0.0  # and how long the compiler took


def mode() -> str:
    """ "build", "off" or "auto", from MSMON_NATIVE_STATS."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on", "build"):
        return "build"
    if value in ("0", "false", "no", "off"):
        return "off"
    return "auto"


def reset() -> None:
    """Forget the loaded kernel, so that the next use decides again (tests)."""
    global _loaded, _tried, compiled_here, build_seconds
    with _lock:
        _loaded, _tried, compiled_here, build_seconds = None, False, False, 0.0


def built_path() -> Optional[str]:
    """The loaded kernel's file, else where this source and compiler would put it (None
    without a compiler)."""
    if _loaded is not None:
        return _loaded.path
    try:
        return build.expected_path()
    except build.BuildError:
        return None


def _module() -> Any:
    if _loaded is not None or _tried:
        return _loaded
    if mode() == "build":
        return load()
    return load_built()


def prepare() -> None:
    """Load or build the kernel now, at attach, rather than in a hook (MSMON_NATIVE_STATS=0: nothing)."""
    if _tried is not True:
        load()


def load_built() -> Any:
    """Load the kernel if it is in the cache; never compile (statistics outside an attach)."""
    global _loaded, _tried
    with _lock:
        if _loaded is not None or _tried:
            return _loaded
        _tried = "looked"
        if mode() == "off":
            return None
        try:
            _loaded = _Kernel(build.find_or_build(allow_build=False).path)
        except build.BuildError:
            pass  # prepare() at attach builds it, or says why not
        except Exception as exc:  # a broken cache must never stop training
            _tried = True  # said once; prepare() would only fail again on the same file
            logger.warning(
                "msmon[rank %d]: the cached native statistics could not be loaded (%s: %s); using torch reductions",
                _rank(),
                type(exc).__name__,
                exc,
            )
        return _loaded


def load() -> Any:
    """Load the kernel, building it if needed; log once and return None on failure.
    With MSMON_NATIVE_STATS=0 nothing is built."""
    global _loaded, _tried, compiled_here, build_seconds
    with _lock:
        if _tried is True:
            return _loaded
        _tried = True
        if _loaded is not None or mode() == "off":
            return _loaded
        try:
            found = build.find_or_build()
            _loaded = _Kernel(found.path)
            if found.compiled:
                compiled_here, build_seconds = True, found.seconds
                logger.info(
                    "msmon[rank %d]: built the native statistics in %.1f s (%s loop): %s",
                    _rank(),
                    found.seconds,
                    _loaded.isa,
                    found.path,
                )
        except Exception as exc:  # a missing compiler must never stop training
            reason = str(exc) if isinstance(exc, build.BuildError) else f"{type(exc).__name__}: {exc}"
            if mode() == "build":  # required (MSMON_NATIVE_STATS=1): a failure is an error
                logger.error(
                    "msmon[rank %d]: %s=1 but the native statistics could not be built or loaded (%s); using torch "
                    "reductions, about twice the CPU cost",
                    _rank(),
                    ENV,
                    reason,
                )
            elif isinstance(exc, build.NoCompiler):
                logger.info(
                    "msmon[rank %d]: %s, so CPU statistics use torch reductions (about twice the CPU "
                    "cost; install g++, or set %s=0 to skip the native statistics)",
                    _rank(),
                    reason,
                    ENV,
                )
            else:
                logger.warning(
                    "msmon[rank %d]: the native statistics could not be built or loaded (%s); using torch reductions",
                    _rank(),
                    reason,
                )
        return _loaded


def stats_rows() -> Optional[Callable[..., torch.Tensor]]:
    """`stats_rows(tensors, threshold, columns, per_element, flat, threads, min_share)`: finished
    rows in the caller's column order (fields divided by the element count where asked), read by
    up to `threads` threads of at least `min_share` elements each; None when not loaded."""
    module = _module()
    return None if module is None else module.stats_rows


def stats_kernel() -> Optional[_Kernel]:
    """The loaded kernel where statistics may use it: None when not loaded, and on the
    accelerator path (MSMON_DEVICE_PATH=1: msmon.stats.device_path), which has no such kernel.
    One call per statistic gives its `readable_rows` and `min_share` together (msmon.stats.engine)."""
    return None if device_path.on() else _module()


def readable_rows() -> Optional[Callable[..., Optional[torch.Tensor]]]:
    """stats_rows' function, giving None instead of raising where a tensor is not eligible(),
    so that the caller checks and packs the tensors in one pass; None where stats_kernel() is."""
    kernel = stats_kernel()
    return None if kernel is None else kernel.readable_rows


# Elements each thread sharing one call reads at least. Torch's OpenMP team starts at once,
# and two of its threads read a 15 MB batch in 1.0 ms where one takes 1.7 (docs/performance.md);
# threads of the kernel's own cost a start each and compete with the team's spinning workers, so
# they only pay on batches of hundreds of MB (a larger model's gradients took a fifth less).
TEAM_SHARE = 1 << 18  # 1 MiB of float32 per thread
OWN_THREADS_SHARE = 1 << 22  # 16 MiB


def share_elements() -> int:
    """The `min_share` for the loaded kernel: smaller when it shares with torch's team."""
    module = _module()
    return OWN_THREADS_SHARE if module is None else module.min_share


def csv_rounding() -> Optional[Callable[..., int]]:
    """fused_stats.cpp's `msmon_csv_round(values, out, n, ndigits, decades, doubtful)` (addresses
    and counts; msmon.output.sinks.numbers.csv_flat calls it), or None when the kernel is not loaded."""
    module = _module()
    return None if module is None else module.csv_round


def isa() -> Optional[str]:
    """The instruction set the kernel's loop uses here ("avx2" or "baseline"); None when not loaded."""
    module = _module()
    return None if module is None else module.isa


_READABLE = (torch.float32, torch.float64)


def eligible(t: torch.Tensor) -> bool:
    """Tensors the kernel reads directly: contiguous, on the CPU, float32 or float64, not empty."""
    return t.dtype in _READABLE and t.is_cpu and t.is_contiguous() and t.numel() > 0


def _rank() -> int:
    from ...system.distributed import current_rank

    return current_rank()


class _Kernel:
    """The loaded library: `stats_rows` (strict, as described in stats_rows() above),
    `readable_rows` (the same, None where a tensor is not readable), `min_share` (the elements
    each thread sharing a call reads at least), `csv_round` and `isa`."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)  # a CDLL call releases the GIL while the kernel reads
        if lib.msmon_stats_abi() != _ABI:
            raise RuntimeError(f"{path} has ABI {lib.msmon_stats_abi()}, not {_ABI}")
        lib.msmon_stats_isa.restype = ctypes.c_char_p
        kernel = lib.msmon_stats_rows
        kernel.restype = ctypes.c_int
        kernel.argtypes = [ctypes.c_char_p]  # the packed call (bytes), passed without a copy
        self.path = path
        self.isa = lib.msmon_stats_isa().decode()
        team = training_team() if os.environ.get(TEAM_ENV, "1") != "0" else None
        lib.msmon_stats_use_team.argtypes = [ctypes.c_void_p] * 3
        lib.msmon_stats_use_team(*(team or (None, None, None)))
        self.team = team is not None  # shares go to torch's OpenMP team, not threads of the kernel's own
        self.min_share = TEAM_SHARE if self.team else OWN_THREADS_SHARE  # share_elements()
        csv_round = lib.msmon_csv_round
        csv_round.restype = ctypes.c_int64
        address, count = ctypes.c_void_p, ctypes.c_int64
        csv_round.argtypes = [address, address, count, count, address, address]
        self.csv_round = csv_round
        self.readable_rows = _rows_of(kernel)
        self.stats_rows = _strict(self.readable_rows)
        self._lib = lib  # keeps the library mapped


def _strict(readable_rows: Callable[..., Optional[torch.Tensor]]) -> Callable[..., torch.Tensor]:
    def stats_rows(xs: Sequence[torch.Tensor], *args: Any) -> torch.Tensor:
        rows = readable_rows(xs, *args)
        if rows is None:
            raise RuntimeError("stats_rows: contiguous, non-empty CPU float32 or float64 tensors")
        return rows

    return stats_rows


ROW_SLAB_ELEMENTS = 1 << 14  # float64 values per block of single-tensor rows (128 KiB)


class _RowSlab(threading.local):
    """Where the rows of single-tensor calls (one per activation and hook) are written: views
    into one float64 block per thread, a new block when the last is full, each freed once no
    row views it. A tensor per row would be three small allocations per activation, made
    between the training's own, in the heap where glibc also puts the training's tensors up to
    its mmap threshold; they fragmented it, and all_xy's peak RSS was 3–4 MiB higher for it
    (docs/performance.md, sixth round)."""

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self.used = 0

    def take(self, width: int) -> torch.Tensor:
        block = self.block
        if block is None or self.used + width > ROW_SLAB_ELEMENTS:
            block = self.block = torch.empty(ROW_SLAB_ELEMENTS, dtype=torch.float64)
            self.used = 0
        start = self.used
        self.used = start + width
        return block.narrow(0, start, width)


def _rows_of(kernel: Any) -> Callable[..., Optional[torch.Tensor]]:
    """The Python side of one kernel call, kept short (docs/performance.md has its cost): the
    whole call packed into one int64 array by one struct.pack, whose layout, column spec and
    result template are cached per call shape, and the rows written straight into a float64
    tensor."""
    shapes: dict[tuple[Any, ...], tuple[torch.Tensor, Any, int, int, tuple[int, ...]]] = {}
    flags = {torch.float32: 0, torch.float64: 1}
    wide_flags = {torch.float32: 2, torch.float64: 1}  # float32 summed in float64
    empty_like = torch.empty_like
    slab = _RowSlab()

    def shape_of(
        columns: Sequence[int], per_element: Sequence[bool], n: int, flat: bool
    ) -> tuple[torch.Tensor, Any, int, int, tuple[int, ...]]:
        if len(columns) != len(per_element):
            raise RuntimeError("stats_rows: one per_element flag per column")
        if not all(0 <= c < _FIELDS for c in columns):
            raise RuntimeError(f"stats_rows: {_ERRORS[2]}")
        if flat and n != 1:
            raise RuntimeError("stats_rows: flat output is for one tensor")
        if len(shapes) > 4096:  # batch sizes are few in practice; never grow without bound
            shapes.clear()
        width = len(columns)
        template = torch.empty(width if flat else (n, width), dtype=torch.float64)
        spec = tuple(c + 8 * bool(p) for c, p in zip(columns, per_element))
        return template, struct.Struct(f"=5qd{width + 3 * n}q").pack, n, width, spec

    def readable_rows(
        xs: Sequence[torch.Tensor],
        threshold: float,
        columns: Sequence[int],
        per_element: Sequence[bool],
        flat: bool,
        threads: int,
        min_share: int,
        wide: bool = False,
    ) -> Optional[torch.Tensor]:
        """`wide`: float32 tensors' sums and sums of squares accumulated in float64 (the bases of
        a derived op: std), as float64 tensors' are."""
        key = (tuple(columns), tuple(per_element), len(xs), flat)
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = shape_of(columns, per_element, len(xs), flat)
        template, pack, n, width, spec = shape
        packed: list[int] = []
        types = wide_flags if wide else flags
        for x in xs:  # checked here: a wrong pointer would be read, not refused
            flag = types.get(x.dtype)
            if flag is None or not x.is_cpu or not x.is_contiguous():
                return None
            numel = x.numel()
            if not numel:
                return None
            packed += (x.data_ptr(), numel, flag)
        out = slab.take(width) if flat and width else empty_like(template)
        # n, width, threads, min_share, out, threshold, columns, inputs (fused_stats.cpp);
        # xs, and with it every tensor read, stays referenced until the call returns
        code = kernel(pack(n, width, threads, min_share, out.data_ptr(), threshold, *spec, *packed))
        if code:
            raise RuntimeError(f"stats_rows: {_ERRORS.get(code, f'error {code}')}")
        return out

    return readable_rows

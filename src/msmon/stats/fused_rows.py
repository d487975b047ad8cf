"""One compiled pass that gives every field of a batch's statistics: the accelerator path's reduction.

The multi-tensor route (msmon.stats.multi_tensor) keeps the number of kernels flat in the number
of tensors, but reads each chunk about a dozen times: one `_foreach_*` reduction or elementwise
pass per field. Where the device has a compiler (Inductor: Triton on CUDA, C++ on the CPU, which
is the test proxy of MSMON_DEVICE_PATH=1), one generated kernel reads each element once and
produces, per row, the values of those fields the configured ops read (one kernel per set):

    sq (sum of squares), sum, zeros (|x| < threshold), nans, infs, max, negmax (max of -x)

over the rows of a [rows, BLOCK] view: whole rows (the blocks of a chunk that lie inside one
tensor, read in place, no mask to compute), and, by a second kernel, rows restricted to their
columns [lo, hi) (the few blocks where tensors meet, copied once per tensor they hold).
Values are accumulated in float32 (float64 for float64 input; a 16-bit input is widened inside
the kernel, with no copy); rows combine exactly afterwards.

The kernel is compiled once per dtype, device and field set (dynamic row count: the same code for
every batch; Inductor's on-disk cache makes later processes load it in about a second). It is never
traced under the caller's modes: a TorchDispatchMode of the user's (a FLOP counter) would make
torch.compile refuse, and msmon's work is not the user's to count, so the call runs with the
Python dispatch modes set aside. KERNELS_PER_CALL says how many kernels one call launches (read
from Inductor's generated code), which benchmarks/op_counts.py adds to its count.

MSMON_COMPILED_STATS=0 keeps this route off (the multi-tensor `_foreach_*` route then runs). A
failure to compile (no C++ compiler, no Triton, a device Inductor does not know) is logged once
per process and turns the route off; the caller then reduces the same batch the other way.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import types
from typing import Callable

import torch

from . import inductor_code

logger = logging.getLogger("msmon")

BLOCK = 1024  # columns of a row: the granularity at which tensors of one chunk are told apart
# the fields one pass can give, those combined by a sum first and by a max last (fused_batch slices them)
FIELDS = ("sq", "sum", "zeros", "nans", "infs", "max", "negmax")
ENV = "MSMON_COMPILED_STATS"
_DEVICES = ("cpu", "cuda")  # where Inductor generates code (C++, Triton)

_lock = threading.Lock()
_compiled: dict[tuple[bool, tuple[str, ...]], Callable[..., torch.Tensor]] = {}  # by (masked, fields)
_failed = False
_preparing = False  # prepare() is compiling: it says so itself
_counted_to = 0  # dynamo's graph count after msmon's last compiled call (or last look)
_others = 0  # graphs dynamo built outside msmon's calls
_tally = threading.local()  # kernels launched by this thread's calls (benchmarks/op_counts.py)
# kernels one call launches, per (dtype, device type, masked, fields): read from the generated code on first use
KERNELS_PER_CALL: dict[tuple[torch.dtype, str, bool, tuple[str, ...]], int] = {}


def _values(
    v: torch.Tensor, inside: torch.Tensor | None, threshold: torch.Tensor, fields: tuple[str, ...]
) -> torch.Tensor:
    """[rows, len(fields)] of v (already in the accumulation dtype), over `inside` where given:
    only the fields asked for (a field costs instructions on every element, and on a CPU the pass
    is bound by them). NaN and Inf are found by comparisons (v != v, |v| == inf), which vectorise
    where isnan does not."""
    a = v.abs()
    if inside is None:
        whole: dict[str, Callable[[], torch.Tensor]] = {
            "sq": lambda: (v * v).sum(1),
            "max": lambda: v.amax(1),
            "negmax": lambda: (-v).amax(1),
            "sum": lambda: v.sum(1),
            "zeros": lambda: (a < threshold).to(v.dtype).sum(1),
            "nans": lambda: (v != v).to(v.dtype).sum(1),
            "infs": lambda: (a == math.inf).to(v.dtype).sum(1),
        }
        return torch.stack([whole[name]() for name in fields], dim=1)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    lowest = torch.full((), -math.inf, dtype=v.dtype, device=v.device)
    masked: dict[str, Callable[[], torch.Tensor]] = {
        "sq": lambda: torch.where(inside, v * v, zero).sum(1),
        "max": lambda: torch.where(inside, v, lowest).amax(1),
        "negmax": lambda: torch.where(inside, -v, lowest).amax(1),
        "sum": lambda: torch.where(inside, v, zero).sum(1),
        "zeros": lambda: (inside & (a < threshold)).to(v.dtype).sum(1),
        "nans": lambda: (inside & (v != v)).to(v.dtype).sum(1),
        "infs": lambda: (inside & (a == math.inf)).to(v.dtype).sum(1),
    }
    return torch.stack([masked[name]() for name in fields], dim=1)


def _accumulated(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _whole_rows(x: torch.Tensor, threshold: torch.Tensor, fields: tuple[str, ...] = FIELDS) -> torch.Tensor:
    """[rows, len(fields)] values of each whole row of x: the blocks that lie inside one tensor,
    most of the data, with no mask to compute. Compiled (one code per fields); eager it is the
    tests' reference."""
    return _values(_accumulated(x), None, threshold, fields)


def _row_values(
    x: torch.Tensor, bounds: torch.Tensor, threshold: torch.Tensor, fields: tuple[str, ...] = FIELDS
) -> torch.Tensor:
    """[rows, len(fields)] values of each row of x over its columns [lo, hi) (bounds: [rows, 2],
    one tensor, so that no two arguments alias, with the rows first, so that its row count is
    x's by construction and no other size is ever taken for it). Compiled (one code per fields);
    eager it is the tests' reference."""
    column = torch.arange(x.shape[1], device=x.device)
    inside = (column[None, :] >= bounds[:, 0:1]) & (column[None, :] < bounds[:, 1:2])
    return _values(_accumulated(x), inside, threshold, fields)


def enabled() -> bool:
    """Whether the route is wanted (MSMON_COMPILED_STATS is not 0), has not failed here, and
    torch.compile is not switched off in this process (TORCHDYNAMO_DISABLE=1: it would run the
    function eagerly, a dozen ops per field)."""
    if _failed or os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("1", "true", "True") and not _dynamo_disabled()


def _dynamo_disabled() -> bool:
    config = getattr(sys.modules.get("torch._dynamo"), "config", None)
    return bool(getattr(config, "disable", False))


def usable(device: torch.device) -> bool:
    """Whether batches on `device` take the compiled pass."""
    return device.type in _DEVICES and enabled()


def _function(masked: bool, fields: tuple[str, ...]) -> Callable[..., torch.Tensor]:
    with _lock:
        key = (masked, fields)
        if key not in _compiled:
            if masked:

                def run(x: torch.Tensor, bounds: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
                    return _row_values(x, bounds, threshold, fields)

            else:

                def run(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:  # type: ignore[misc]
                    return _whole_rows(x, threshold, fields)

            _compiled[key] = torch.compile(_own_code(run, masked, fields), dynamic=True, fullgraph=True)
        return _compiled[key]


def _own_code(
    function: Callable[..., torch.Tensor], masked: bool, fields: tuple[str, ...]
) -> Callable[..., torch.Tensor]:
    """`function` with a code object of its own. Dynamo keeps a code object's compiled graphs
    together, eight at most (its recompile limit; past it, fullgraph=True fails), and every field
    set's closure shares one code: with several sets, their dtypes would add up past the limit."""
    name = ("masked_" if masked else "whole_") + "_".join(fields)
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)


def row_values(
    x: torch.Tensor, bounds: torch.Tensor | None, threshold: torch.Tensor, fields: tuple[str, ...] = FIELDS
) -> torch.Tensor | None:
    """The compiled values of the rows of x ([rows >= 2, BLOCK]), [rows, len(fields)]: each row
    whole (bounds None) or over its columns [lo, hi) (bounds [rows, 2]); None when the route
    failed here (logged once; the caller reduces the batch another way). `fields`: a subset of
    FIELDS in FIELDS' order."""
    global _failed
    key = (x.dtype, x.device.type, bounds is not None, fields)
    first = key not in KERNELS_PER_CALL
    _note_others()
    try:
        known = inductor_code.loaded_modules() if first else None
        started = time.perf_counter()
        with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
            function = _function(bounds is not None, fields)
            if first and _alignment_matters(x.device):
                function(*_with_x(_unaligned_like(x), bounds, threshold))
            out = function(*_with_x(_plain(x), bounds, threshold))
        if first:
            KERNELS_PER_CALL[key] = inductor_code.kernels_in(inductor_code.loaded_modules() - (known or set()))
            took = time.perf_counter() - started
            if took > 2.0 and not _preparing:  # a dtype attach did not foresee (autocast's, say)
                logger.info(
                    "msmon: compiled the statistics kernel for %s %s on first use in %.1f s "
                    "(once per machine: Inductor caches it)",
                    x.device.type,
                    str(x.dtype).removeprefix("torch."),
                    took,
                )
    except Exception as exc:  # noqa: BLE001 - a compiler missing or refusing: the other route runs
        if not _failed:
            logger.warning(
                "msmon: the compiled statistics pass is off in this process (%s: %s); "
                "the multi-tensor torch route computes the same values with more kernels",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
        _failed = True
        return None
    finally:
        global _counted_to
        _counted_to = _graph_count()
    _tally.kernels = getattr(_tally, "kernels", 0) + KERNELS_PER_CALL.get(key, 1)
    return out


def _graph_count() -> int:
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    try:
        return int(counters["stats"]["unique_graphs"]) if counters is not None else 0
    except (KeyError, TypeError, ValueError):
        return 0


def _note_others() -> None:
    """Graphs dynamo counted since msmon's last call are somebody else's (the user's)."""
    global _others
    now = _graph_count()
    if now > _counted_to:
        _others += now - _counted_to


def users_graphs_compiled() -> bool:
    """Whether torch.compile built a graph in this process other than msmon's own compiled
    statistics (dynamo counts every graph together; a count dropped by a reset of dynamo's
    counters loses nothing already seen)."""
    _note_others()
    global _counted_to
    _counted_to = _graph_count()
    return _others > 0


def prepare(tensors: list[torch.Tensor], fields: tuple[str, ...] = FIELDS) -> None:
    """Compile (or load from Inductor's cache) the kernels of `fields` (what the configured ops
    read) for these tensors' devices and dtypes, and float32 on the same devices, now, at
    attach, rather than in the first step: a first compile takes seconds (tens on a CPU), a
    cached one about one. Devices that keep their own code (the CPU without MSMON_DEVICE_PATH=1)
    compile nothing."""
    from .device_path import host_code

    if not fields:  # the ops are all of their own reductions (ops.register): nothing to compile
        return
    wanted = {(t.device, t.dtype) for t in tensors if t.is_floating_point() and not host_code(t.device)}
    wanted |= {(device, torch.float32) for device, _ in wanted}
    wanted = {(device, dtype) for device, dtype in wanted if usable(device)}
    global _preparing
    started = time.perf_counter()
    _preparing = True
    try:
        compiled = _prepare_each(wanted, fields)
    finally:
        _preparing = False
    took = time.perf_counter() - started
    if compiled and took > 2.0:
        kinds = ", ".join(f"{d.type} {str(dtype).removeprefix('torch.')}" for d, dtype in sorted(wanted, key=str))
        logger.info(
            "msmon: compiled the statistics kernels for %s in %.1f s (once per machine: Inductor caches them)",
            kinds,
            took,
        )


def _prepare_each(wanted: set[tuple[torch.device, torch.dtype]], fields: tuple[str, ...]) -> bool:
    """Compile both kernels for each (device, dtype); False when the route failed (said once)."""
    for device, dtype in sorted(wanted, key=str):
        x = torch.zeros(3, BLOCK, dtype=dtype, device=device)  # three rows: see _unaligned_like
        threshold = torch.zeros((), dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device)
        bounds = torch.tensor([[0, BLOCK]] * 3, device=device)
        # on the training's thread count, as the statistics run (the code is guarded on it)
        if row_values(x, None, threshold, fields) is None or row_values(x, bounds, threshold, fields) is None:
            return False  # said once by row_values; the torch route runs
    return bool(wanted)


def _with_x(x: torch.Tensor, bounds: torch.Tensor | None, threshold: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if bounds is None:
        return (x, threshold)
    return (x, bounds if x.shape[0] == bounds.shape[0] else bounds[: x.shape[0]].clone(), threshold)


def _alignment_matters(device: torch.device) -> bool:
    """Whether Inductor's code for `device` assumes aligned inputs (GPUs: Triton)."""
    return device.type != "cpu"


def _plain(x: torch.Tensor) -> torch.Tensor:
    """x as a tensor of its own over the same memory, not a view: the compiled code is guarded on
    an input's view base when it has one, so views and non-views (a chunk's view, the boundary
    matrix) would each compile once more."""
    if x._base is None:
        return x
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(
        x.untyped_storage(), x.storage_offset(), x.shape, x.stride()
    )


def _unaligned_like(x: torch.Tensor) -> torch.Tensor:
    """Three rows like x's at an odd element offset (three: no size of the first compile may
    equal another by chance, which would tie them in the generated code). Compiled first on a GPU, it makes Inductor
    generate code for any alignment: code compiled for an aligned input copies every input that
    is not (Inductor's copy_misaligned_inputs), and a span of a framework's flat buffer may start
    anywhere."""
    return _plain(torch.zeros(3 * BLOCK + 1, dtype=x.dtype, device=x.device)[1:].view(3, BLOCK))


def launched_kernels() -> int:
    """Kernels launched by this thread's compiled calls so far (a running count)."""
    return int(getattr(_tally, "kernels", 0))

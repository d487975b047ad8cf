"""Keep torch on one thread inside msmon's own threads (the writer, the replica exchange).

torch's CPU kernels run in OpenMP teams, and every thread that runs a parallel kernel gets a
team of its own: the first torch op of msmon's writer thread that goes parallel (a large step
table, or an MKL vector function such as log10 whatever the size) starts one more OS thread per
core. With more OpenMP threads than cores, the training's parallel regions wait for their
workers: on the reference model (2 cores, 2 torch threads) a plain step went from 57 to 84 ms in
the same process, for 1 ms of writer CPU per step, with cores left idle
(docs/performance.md, fifth round). `torch.set_num_threads(1)`
would avoid it but also changes process-wide settings (the default of threads created later,
the pthreadpool); the OpenMP runtime's `omp_set_num_threads` sets the calling thread's own
count only, so that is what is called, through ctypes, after torch's per-thread set-up (which
would otherwise overwrite it on the thread's first parallel op).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
from typing import Any, Callable

logger = logging.getLogger("msmon")

_RUNTIME = re.compile(r"^lib(gomp|iomp5|omp)[.-]")


def _loaded_runtimes() -> list[str]:
    """The files of the OpenMP runtimes mapped into this process (torch's, and any other
    library's); empty where /proc cannot say."""
    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.startswith("/") and _RUNTIME.match(os.path.basename(path)) and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    return candidates


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads() -> tuple[Callable[[int], Any], ...]:
    """`omp_set_num_threads` of every OpenMP runtime the process has loaded (each keeps its
    own per-thread count), or of the global namespace."""
    candidates = _loaded_runtimes()
    found: list[Callable[[int], Any]] = []
    libraries: list[str | None] = list(candidates) or [None]  # None: what the process loaded globally
    for library in libraries:
        try:
            fn = ctypes.CDLL(library).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        found.append(fn)
    return tuple(found)


def torch_on_this_thread_only() -> bool:
    """Make torch's CPU kernels called from the current thread run on it alone (no OpenMP
    team of its own); the training's threads are not affected. False where no OpenMP runtime
    was found (then there is no team to avoid either, or msmon cannot reach it). Never raises:
    the thread works the same without it, only more costly for the training."""
    try:
        import torch

        torch.get_num_threads()  # torch's per-thread set-up first: it would reset the count later
        runtimes = _omp_set_num_threads()
        for set_num_threads in runtimes:
            set_num_threads(1)
    except Exception as exc:
        logger.debug("msmon: could not keep torch on this thread alone: %r", exc)
        return False
    if not runtimes:
        logger.debug("msmon: no OpenMP runtime found; torch ops on msmon's threads keep torch's setting")
    return bool(runtimes)


def training_team() -> tuple[int, int, int] | None:
    """The addresses of `GOMP_parallel`, `omp_get_thread_num` and `omp_get_num_threads` of the
    OpenMP runtime torch runs its parallel ops on, for the native kernel to share a large read
    with the team torch already keeps awake; None unless exactly one runtime is loaded (with
    two, which one torch uses is not known, and a second team is what must be avoided)."""
    import torch  # noqa: F401  (torch loads its runtime)

    runtimes = _loaded_runtimes()
    if len(runtimes) != 1:
        return None
    try:
        lib = ctypes.CDLL(runtimes[0])
        names = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
        addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names]
    except (OSError, AttributeError):
        return None
    if not all(addresses):
        return None
    return addresses[0], addresses[1], addresses[2]  # type: ignore[return-value]

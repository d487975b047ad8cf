"""Let gloo's collectives finish and be released while the interpreter is whole.

Why. A gloo collective runs on one of its process group's `pt_gloo_runloop` threads, which
hold a reference to its Work until the work is done. When Python has already dropped its own
reference (a sync collective returned, or an async one the script never waited for), that
thread releases the Work last, and with it the Work's tensors; in torch 2.13 releasing a C++
reference to a tensor that has a Python object decrefs that object, so the thread takes the
GIL. If the main thread is finalizing the interpreter by then, `take_gil` ends the thread
with `pthread_exit`, whose forced unwind crosses a noexcept destructor: `std::terminate`, and
the rank dies of SIGABRT ("terminate called without an active exception") after its work
was done. Any collective that completes near exit can do this, msmon's own (agreement.py's
rounds, the sharded statistics' gather, the replica check's exchange on its own group) and
the script's. Holding a finished Work until the next collective keeps its tensors that long:
the script's device collectives are never held (`_on_host`), and msmon's own carry a few
numbers per tensor.

How. Python keeps a reference to every collective's Work on host tensors until it is done
(and seen done at a later collective), so a gloo thread never releases one last while the
script runs (`hold`; under `msmon run`, `track_process_groups` makes ProcessGroup's
collectives pass their Works through `hold`). At exit, an atexit handler that runs after the
script's own and after the monitors closed (atexit is last-in first-out), `drain` waits for
every held Work within one deadline (`MSMON_EXIT_DRAIN_SECONDS`, 10 s by default: never a
hang), leaves the GIL free a moment for gloo threads finishing a release, releases the
finished Works from the main thread, keeps the unfinished ones referenced for good (so no
gloo thread ever releases them), and runs msmon's own clean-ups (`at_drain`: the replica
check destroys its group when its exchange thread is idle). It never waits on a collective
the script has not issued, never destroys a group of the script's, and never changes the
exit code: every failure is swallowed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from . import process_end

logger = logging.getLogger("msmon")

ENV_SECONDS = "MSMON_EXIT_DRAIN_SECONDS"
DEFAULT_SECONDS = 10.0
SETTLE_SECONDS = 0.05  # the GIL left free after the waits, for gloo threads that release a Work

# ProcessGroup's collectives that a gloo backend queues to its worker threads
COLLECTIVES = (
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single",
    "scatter",
)

_lock = threading.Lock()
_held: dict[int, list[Any]] = {}  # id(work) -> [work, seen finished at an earlier collective]
_releases: list[Callable[[], None]] = []  # msmon's own clean-ups after the waits (its groups)
_installed_pid: int | None = None
_tracked: dict[str, Any] = {}  # ProcessGroup method name -> the original
_inherited: list[Any] = []  # a forked child's copies of its parent's held Works: never waited for nor released


def install() -> None:
    """Register the exit drain once per process. A forked child registers its own, and keeps
    what it inherited of its parent's (their Works are the parent's) out of its waits."""
    global _installed_pid
    if _installed_pid == os.getpid():
        return
    if _installed_pid is not None:
        with _lock:
            _inherited.extend(_held.values())
            _held.clear()
            _releases.clear()
    _installed_pid = os.getpid()
    process_end.at_end(functools.partial(_drain_at_exit, os.getpid()))


def hold(work: Any) -> Any:
    """Keep `work` referenced until it is done (see the module docstring); returns it."""
    if work is None:
        return work
    install()
    with _lock:
        released = _prune()
        _held[id(work)] = [work, False]
    del released  # outside the lock: a Work's destructor may wait for the GIL
    return work


def at_drain(release: Callable[[], None]) -> None:
    """Run `release` at exit after the waits, while the interpreter is whole: msmon destroys
    its own process groups there (`destroy_group`)."""
    install()
    with _lock:
        if release not in _releases:
            _releases.append(release)


def destroy_group(group: Any) -> bool:
    """Destroy one of msmon's own process groups (never one of the script's); False when
    torch.distributed is gone or the group was destroyed already."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False
        if group not in dist.distributed_c10d._world.pg_map:
            return False
        dist.destroy_process_group(group)
        return True
    except Exception as exc:
        logger.debug("msmon: could not destroy its process group at exit: %r", exc)
        return False


def track_process_groups() -> None:
    """Make every ProcessGroup collective on host tensors pass its Work through `hold` (under
    `msmon run`: the script's collectives, which msmon cannot otherwise see end)."""
    try:
        from torch._C._distributed_c10d import ProcessGroup
    except ImportError:  # a torch built without distributed support: nothing to track
        return
    install()
    for name in COLLECTIVES:
        original = ProcessGroup.__dict__.get(name)
        if original is None or name in _tracked:
            continue
        _tracked[name] = original
        setattr(ProcessGroup, name, _holding(original))


def held() -> int:
    """How many Works are held now."""
    with _lock:
        return len(_held)


def drain(seconds: float | None = None) -> dict[str, int]:
    """Wait for every held Work (all within `seconds`), release the finished ones, keep the
    others for good, and destroy msmon's idle groups. Counts of each, for the log and tests."""
    deadline = time.monotonic() + (_seconds() if seconds is None else seconds)
    with _lock:
        works = [entry[0] for entry in _held.values()]
        _held.clear()
        releases = list(_releases)
        _releases.clear()
    unfinished = [work for work in works if not _wait(work, deadline)]
    if works:
        time.sleep(SETTLE_SECONDS)  # without the GIL: a gloo thread finishing a release takes it now
    for work in unfinished:  # referenced beyond the interpreter's own teardown, on purpose
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
    for release in releases:
        try:
            release()
        except Exception as exc:
            logger.debug("msmon: a clean-up at exit failed: %r", exc)
    return {"waited": len(works), "unfinished": len(unfinished)}


def _holding(original: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        work = original(*args, **kwargs)
        try:
            if _on_host(args):
                hold(work)
        except Exception:  # bookkeeping only: the collective's result goes back untouched
            pass
        return work

    return collective


def _on_host(args: tuple) -> bool:
    """Whether the collective's first tensor argument is on the host (gloo's queue; an
    accelerator's backend is left alone: holding its Works would delay freeing device memory)."""
    for arg in args[1:]:  # args[0] is the group
        found = _first_tensor(arg)
        if found is not None:
            return found.device.type == "cpu"
    return False


def _first_tensor(value: Any, depth: int = 0) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if depth < 2 and isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def _prune() -> list[Any]:
    """Take out the Works seen finished at an earlier collective (their gloo thread has long
    let go; the interpreter is whole) for the caller to release; mark the newly finished ones.
    Caller holds _lock."""
    released = []
    for key, entry in list(_held.items()):
        try:
            done = entry[0].is_completed()
        except Exception:
            done = True
        if done and entry[1]:
            released.append(_held.pop(key)[0])
        elif done:
            entry[1] = True
    return released


def _wait(work: Any, deadline: float) -> bool:
    """Whether `work` finished (with or without an error) before `deadline`."""
    from datetime import timedelta

    try:
        if work.is_completed():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        work.wait(timedelta(seconds=remaining))
    except Exception:  # timed out, or the collective failed: the script's business, not the exit's
        pass
    try:
        return bool(work.is_completed())
    except Exception:
        return False


def _seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_SECONDS, DEFAULT_SECONDS)))
    except ValueError:
        return DEFAULT_SECONDS


def _drain_at_exit(pid: int) -> None:
    if os.getpid() != pid:  # a forked child inherited the handler: its parent's Works are not its own
        return
    try:
        counts = drain()
        if counts["unfinished"]:
            logger.warning(
                "msmon: %d collective(s) still unfinished at exit after %.0f s; kept so that no gloo thread "
                "releases them while the interpreter shuts down",
                counts["unfinished"],
                _seconds(),
            )
    except Exception as exc:  # the exit goes on as it would have
        logger.debug("msmon: exit drain failed: %r", exc)

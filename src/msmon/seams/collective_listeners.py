"""The collective-call listener API: wrap torch.distributed's collectives so listeners see the
tensors that go through them. Below the collectors (the comm collector is a listener) and the
torch_distributed instrumentor (hooks/torch_distributed/instrumentor.py holds the wrapping for
the whole process), so both import it from here.

`acquire()` replaces each collective in `torch.distributed` (and `distributed_c10d`, where
torch's own code looks them up) by a wrapper that tells the registered listeners about the call:
once at launch (the data before the op) and once when the result is in the buffers (the data
after it). A synchronous op completes when it returns; an async op (`async_op=True`, isend,
irecv, batch_isend_irecv) completes when its `Work.wait()` returns, so `Work.wait` is wrapped
too. The wrappers know nothing about statistics: listeners decide what to measure.

Guarantees, because monitoring must never change or break training:
- the original collective is called exactly once with the caller's arguments, whatever a
  listener does; a failure in the wrapper's own bookkeeping is logged once and ignored;
- a collective called from inside another (batch_isend_irecv calls isend) is reported once;
- under torch.compile the wrapper calls the original straight away, so dynamo still rewrites
  it to a functional collective.

Wrapping is reference counted: the launcher holds it from the moment torch is imported (the
hooks registry calls the instrumentor's `instrument(session)`, which does nothing when the
config leaves cc_distribution off), and each monitor's collector holds it from attach to detach
(`acquire()`/`release()`); the originals come back when the last hold goes. Code that copied a
collective (`from torch.distributed import all_reduce`) before the wrapping keeps the original
and is not seen; after unwrapping, a copied wrapper just passes through. `P2POp.op` always reads
as the current isend/irecv, so P2POps built from either version keep working with
batch_isend_irecv (torch compares them by identity).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .collective_calls import (
    ALWAYS_ASYNC,
    COLLECTIVES,
    CollectiveCall,
    CollectiveListener,
    Getter,
    Spec,
    find_call_site,
    tensors_of,
)

logger = logging.getLogger("msmon")

_NAMESPACES = ("torch.distributed", "torch.distributed.distributed_c10d")
MAX_PENDING = 4096


# -- state ----------------------------------------------------------------------------------------
class _Local(threading.local):
    depth = 0


_local = _Local()
_listeners: list[CollectiveListener] = []
_originals: dict[str, Callable[..., Any]] = {}
_wrappers: dict[str, Callable[..., Any]] = {}
_original_wait: Callable[..., Any] | None = None
_refcount = 0
_lock = threading.RLock()
_reported: set[str] = set()


@dataclass
class _Pending:
    works: list[Any]
    call: CollectiveCall
    listeners: list[CollectiveListener]


_pending: dict[int, _Pending] = {}  # id(work) -> the async call it belongs to


def _report_once(where: str, exc: BaseException) -> None:
    if where not in _reported:
        _reported.add(where)
        logger.error(
            "msmon[rank %s]: collective monitoring (%s) failed and skips this call; training continues. %s: %s",
            os.environ.get("RANK", "0"),
            where,
            type(exc).__name__,
            exc,
        )


def add_listener(listener: CollectiveListener) -> None:
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def remove_listener(listener: CollectiveListener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        for entry in _pending.values():
            entry.listeners = [x for x in entry.listeners if x is not listener]
        for key in [k for k, entry in _pending.items() if not entry.listeners]:
            del _pending[key]


# -- the wrappers ---------------------------------------------------------------------------------
def _getter(positions: dict[str, int], args: tuple, kwargs: dict) -> Getter:
    def get(name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        index = positions.get(name)
        return args[index] if index is not None and index < len(args) else None

    return get


def _launch(
    name: str, spec: Spec, positions: dict[str, int], args: tuple, kwargs: dict
) -> tuple[CollectiveCall, list[CollectiveListener]] | None:
    """Tell interested listeners a call starts; never raises."""
    try:
        listeners = [x for x in list(_listeners) if x.wants()]
        if not listeners:
            return None
        get = _getter(positions, args, kwargs)
        before, after = spec(get)
        async_op = name in ALWAYS_ASYNC or bool(get("async_op"))
        group = get("group")
        if name == "batch_isend_irecv":
            ops = get("p2p_op_list") or []
            group = getattr(ops[0], "group", None) if ops else None
        call = CollectiveCall(
            name, find_call_site(sys._getframe(2)), tensors_of(before), tensors_of(after), group, async_op
        )
    except Exception as exc:
        _report_once(f"{name} launch", exc)
        return None
    keep = []
    for listener in listeners:
        try:
            if listener.on_launch(call):
                keep.append(listener)
        except Exception as exc:
            _report_once(f"{name} launch", exc)
    return (call, keep) if keep else None


def _works_of(result: Any) -> list[Any]:
    if isinstance(result, dist.Work):
        return [result]
    if isinstance(result, list):
        return [w for w in result if isinstance(w, dist.Work)]
    return []


def _complete(launched: tuple[CollectiveCall, list[CollectiveListener]], result: Any) -> None:
    """The op returned: report now (sync) or when its work is waited on (async); never raises."""
    call, listeners = launched
    try:
        works = _works_of(result)
        if works:
            with _lock:
                if len(_pending) >= MAX_PENDING:  # works nobody waits on: forget the oldest
                    del _pending[next(iter(_pending))]
                entry = _Pending(works, call, listeners)
                for work in works:
                    _pending[id(work)] = entry
        elif not call.async_op:  # an async op without a handle (coalescing) has no known end
            _deliver(call, listeners)
    except Exception as exc:
        _report_once(f"{call.op} completion", exc)


def _deliver(call: CollectiveCall, listeners: list[CollectiveListener]) -> None:
    for listener in listeners:
        try:
            listener.on_complete(call)
        except Exception as exc:
            _report_once(f"{call.op} completion", exc)


def _on_waited(work: Any) -> None:
    try:
        with _lock:
            entry = _pending.pop(id(work), None)
            if entry is None:
                return
            entry.works = [w for w in entry.works if w is not work]
            if entry.works:
                return
        _deliver(entry.call, entry.listeners)
    except Exception as exc:
        _report_once("Work.wait", exc)


def deliver_completed() -> None:
    """Report async calls whose work finished without anyone calling wait() on it."""
    with _lock:
        entries = {id(e): e for e in _pending.values()}.values()
        done = [e for e in entries if all(w.is_completed() for w in e.works)]
        for entry in done:
            for work in entry.works:
                _pending.pop(id(work), None)
    for entry in done:
        _deliver(entry.call, entry.listeners)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _make_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    spec = COLLECTIVES[name]
    try:
        positions = {p: i for i, p in enumerate(inspect.signature(original).parameters)}
    except (TypeError, ValueError):
        positions = {}

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling() or not _listeners or _local.depth:
            return original(*args, **kwargs)
        launched = _launch(name, spec, positions, args, kwargs)
        _local.depth += 1
        try:
            result = original(*args, **kwargs)
        finally:
            _local.depth -= 1
        if launched is not None:
            _complete(launched, result)
        return result

    collective.__msmon_original__ = original  # type: ignore[attr-defined]
    return collective


def _wait(self: Any, *args: Any, **kwargs: Any) -> Any:
    assert _original_wait is not None
    result = _original_wait(self, *args, **kwargs)
    if _pending:
        _on_waited(self)
    return result


# -- P2POp: torch compares P2POp.op with isend/irecv by identity --------------------------------
def _current_p2p(op: Any) -> Any:
    """The isend/irecv that torch.distributed holds now, for either version of it."""
    name = getattr(op, "__name__", None)
    if name in ("isend", "irecv") and getattr(op, "__msmon_original__", op) is _originals.get(name):
        return getattr(dist.distributed_c10d, name)
    return op


def _install_p2p_shim() -> None:
    """Once: P2POp.op reads as the current isend/irecv, and construction accepts both."""
    c10d = dist.distributed_c10d
    if getattr(c10d.P2POp, "__msmon_shim__", False):
        return
    check_op = c10d._check_op

    def _check_op(op: Any) -> None:
        check_op(_current_p2p(op))

    _check_op.__msmon_original__ = check_op  # type: ignore[attr-defined]

    def get_op(self: Any) -> Any:
        return _current_p2p(self.__dict__.get("op"))

    def set_op(self: Any, value: Any) -> None:
        self.__dict__["op"] = value

    c10d._check_op = _check_op
    # monkeypatching torch's class: its `op` becomes a property, and it carries the marker
    c10d.P2POp.op = property(get_op, set_op, doc="isend or irecv (the current version)")  # type: ignore[assignment]
    c10d.P2POp.__msmon_shim__ = True  # type: ignore[attr-defined]


# -- holding the wrappers -----------------------------------------------------------------------
def acquire() -> bool:
    """A monitor's hold: wrap the collectives if nobody has yet (counted). False when
    torch.distributed is unavailable."""
    global _refcount, _original_wait
    if not dist.is_available():
        return False
    with _lock:
        _refcount += 1
        if _refcount > 1:
            return True
        c10d = dist.distributed_c10d
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            original = getattr(original, "__msmon_original__", original)
            _originals[name] = original
            _wrappers[name] = wrapper = _make_wrapper(name, original)
            for module_name in _NAMESPACES:
                module = sys.modules[module_name]
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
        _install_p2p_shim()
        if dist.Work.wait is not _wait:
            _original_wait = dist.Work.wait  # kept after release: a copied _wait still works
        dist.Work.wait = _wait  # type: ignore[method-assign]  # monkeypatching torch's Work.wait
    return True


def release() -> None:
    """Undo one acquire(); the last one puts the originals back where they were replaced."""
    global _refcount
    with _lock:
        if _refcount == 0:
            return
        _refcount -= 1
        if _refcount:
            return
        for name, wrapper in _wrappers.items():
            for module_name in _NAMESPACES:
                module = sys.modules[module_name]
                if getattr(module, name, None) is wrapper:
                    setattr(module, name, _originals[name])
        _wrappers.clear()
        if _original_wait is not None and dist.Work.wait is _wait:
            dist.Work.wait = _original_wait  # type: ignore[method-assign]  # undoing the monkeypatch
        _pending.clear()


def is_instrumented() -> bool:
    return _refcount > 0

"""Forward hooks on the user's modules that the user's own objects never see.

A module keeps its forward hooks in plain dicts of its `__dict__`, so `torch.save(model)`,
`pickle`, `copy.deepcopy` and `copy.copy` would carry msmon's hooks along: pickling fails (the
hooks are closures) and a deep copy (an EMA or teacher model) would be recorded under the
original's names. msmon registers its module hooks through this module, which remembers their
handle ids, and gives `nn.Module` a `__reduce_ex__` that drops exactly those ids from the
state being pickled or copied. Everything else about the module, its other hooks included, is
reduced by Python's own `object.__reduce_ex__` as before; a module with no msmon hook is not
touched at all. `__reduce_ex__` rather than `__getstate__`, because modules such as the RNNs
and DDP define their own `__getstate__` without calling Module's. The method is added while
any msmon hook exists and removed with the last one.

`torch.jit.script` compiles every forward hook of the modules it scripts, and msmon's hooks
(closures) cannot be compiled, so scripting a monitored model failed. While any msmon hook
exists, torch's `create_script_module` is wrapped to hide exactly msmon's entries from the
modules it reads, and to put them back, in their order, when it returns: the ScriptModule runs
without monitoring, and the eager model keeps its hooks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, SupportsIndex

import torch
from torch.utils.hooks import RemovableHandle

# the per-module dicts a forward hook id appears in (torch/nn/modules/module.py)
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)

_compiler = getattr(torch, "compiler", None)
# inside a torch.compile trace msmon's hooks do nothing (the tracer folds them away: no graph break)
is_compiling: Callable[[], bool] = getattr(_compiler, "is_compiling", None) or (lambda: False)
_tracing_state: Callable[[], Any] = getattr(torch._C, "_get_tracing_state", None) or (lambda: None)
_interpreters: Callable[[], Any] = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None) or (
    lambda: None
)
# torch's own probes, for a hook's fast check (no Python frame of msmon's per hook call): both
# None outside a transform; then transform_running() says which
tracing_state, interpreter_stack = _tracing_state, _interpreters


def transform_running() -> str | None:
    """The program transform msmon's hooks are running inside, or None (plain eager code).

    A hook that ran its statistics there would change what the transform builds: inside
    `torch.jit.trace` its ops join the traced graph (the trace check then fails), inside a
    `torch.func` transform (vmap, grad: per-sample gradients) it sees wrapped tensors without
    storage. So msmon steps aside, as it does inside a torch.compile trace."""
    if is_compiling():
        return "torch.compile"
    if _tracing_state() is not None:
        return "torch.jit.trace"
    if _interpreters() is not None:
        return "torch.func"
    return None


_ours: set[int] = set()
_lock = threading.Lock()
_scripting: Any = None  # msmon's wrapper of torch.jit._recursive.create_script_module, while installed


class GuestHandle:
    """Removes one msmon module hook (the `RemovableHandle` interface collectors use)."""

    __slots__ = ("_handle",)

    def __init__(self, handle: RemovableHandle) -> None:
        self._handle = handle

    def remove(self) -> None:
        self._handle.remove()
        with _lock:
            _ours.discard(self._handle.id)
            if not _ours:
                _uninstall()


def forward_pre_hook(module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> GuestHandle:
    """`module.register_forward_pre_hook(hook)`, hidden from pickling and copying."""
    return _own(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs))


def forward_hook(module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> GuestHandle:
    """`module.register_forward_hook(hook)`, hidden from pickling and copying."""
    return _own(module.register_forward_hook(hook, with_kwargs=with_kwargs))


def _own(handle: RemovableHandle) -> GuestHandle:
    with _lock:
        _ours.add(handle.id)
        _install()
    return GuestHandle(handle)


def _without_ours(state: Any) -> Any:
    """A copy of a module's state without msmon's hook entries (the state itself when it has none)."""
    if not isinstance(state, dict):
        return state
    changed = None
    for name in _HOOK_DICTS:
        hooks = state.get(name)
        if isinstance(hooks, dict) and not _ours.isdisjoint(hooks):
            if changed is None:
                changed = dict(state)
            changed[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in _ours)
    return state if changed is None else changed


def _module_reduce_ex(self: torch.nn.Module, protocol: SupportsIndex) -> str | tuple[Any, ...]:
    reduced = object.__reduce_ex__(self, protocol)
    if not _ours or not isinstance(reduced, tuple) or len(reduced) < 3:
        return reduced
    state = reduced[2]
    if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
        clean: Any = (_without_ours(state[0]), state[1])
        if clean[0] is state[0]:
            return reduced
    else:
        clean = _without_ours(state)
        if clean is state:
            return reduced
    return reduced[:2] + (clean,) + reduced[3:]


def _hidden_from_scripting(create: Callable[..., Any]) -> Callable[..., Any]:
    def create_script_module(nn_module: Any, *args: Any, **kwargs: Any) -> Any:
        saved = []
        modules = nn_module.modules() if isinstance(nn_module, torch.nn.Module) else ()
        with _lock:
            ours = set(_ours)
        for module in modules:
            for name in _HOOK_DICTS:
                hooks = module.__dict__.get(name)
                if isinstance(hooks, dict) and not ours.isdisjoint(hooks):
                    saved.append((hooks, list(hooks.items())))
                    for key in ours.intersection(hooks):
                        del hooks[key]
        try:
            return create(nn_module, *args, **kwargs)
        finally:
            for hooks, items in saved:
                hooks.clear()
                hooks.update(items)

    create_script_module.__wrapped__ = create  # type: ignore[attr-defined]
    return create_script_module


def _install() -> None:
    if torch.nn.Module.__dict__.get("__reduce_ex__") is None:
        # patched on purpose; typeshed types object.__reduce_ex__'s self as any object, this one is for modules
        torch.nn.Module.__reduce_ex__ = _module_reduce_ex  # type: ignore[method-assign, assignment]
    global _scripting
    recursive = getattr(torch.jit, "_recursive", None)
    create = getattr(recursive, "create_script_module", None)
    if create is not None and _scripting is None:
        _scripting = _hidden_from_scripting(create)
        recursive.create_script_module = _scripting  # type: ignore[union-attr]


def _uninstall() -> None:
    if torch.nn.Module.__dict__.get("__reduce_ex__") is _module_reduce_ex:
        del torch.nn.Module.__reduce_ex__
    global _scripting
    recursive = getattr(torch.jit, "_recursive", None)
    if _scripting is not None and getattr(recursive, "create_script_module", None) is _scripting:
        recursive.create_script_module = _scripting.__wrapped__  # type: ignore[union-attr]
        _scripting = None

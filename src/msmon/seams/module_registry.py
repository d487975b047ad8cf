"""Which nn.Modules exist, so that an optimizer's model can be found without being told.

Every module that registers a parameter or a child module is remembered, weakly and in the
order first seen, through torch's global registration hooks (public API; nn.Module itself is
not patched). The model an optimizer trains is then the set of *root* modules (modules that
are nobody's child) owning at least one of its parameters: `DistributedDataParallel(model)`
is a root whose names carry a `module.` prefix that msmon's naming removes, so wrappers
never double the names up.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Iterable

import torch
from torch.nn.modules import module as nn_module


class ModuleTracker:
    """Remembers modules as they are built; `roots_owning()` finds an optimizer's model."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[int, weakref.ref]] = {}  # id -> (order first seen, weak ref)
        self._counter = itertools.count()
        self._handles: list = []

    def start(self) -> None:
        if not self._handles:
            self._handles = [
                nn_module.register_module_module_registration_hook(self._on_child),
                nn_module.register_module_parameter_registration_hook(self._on_param),
            ]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _remember(self, module: torch.nn.Module) -> None:
        key = id(module)
        known = self._refs.get(key)
        if known is not None and known[1]() is module:
            return
        refs = self._refs

        def forget(ref: weakref.ref, key: int = key) -> None:
            if refs.get(key, (0, None))[1] is ref:
                del refs[key]

        self._refs[key] = (next(self._counter), weakref.ref(module, forget))

    def _on_child(self, parent: torch.nn.Module, _name: str, child: torch.nn.Module | None) -> None:
        try:
            self._remember(parent)
            if child is not None:
                self._remember(child)
        except Exception:  # tracking must never stop a model from being built
            pass
        return None

    def _on_param(self, module: torch.nn.Module, _name: str, _param: torch.Tensor) -> None:
        try:
            self._remember(module)
        except Exception:
            pass
        return None

    def modules(self) -> list[torch.nn.Module]:
        """The live tracked modules, in the order first seen."""
        alive = [(order, ref()) for order, ref in sorted(list(self._refs.values()), key=lambda item: item[0])]
        return [m for _, m in alive if m is not None]

    def roots_owning(self, param_ids: set[int]) -> list[torch.nn.Module]:
        return roots_owning(self.modules(), param_ids)


def roots_owning(modules: Iterable[torch.nn.Module], param_ids: set[int]) -> list[torch.nn.Module]:
    """The modules among `modules` that are no other one's child and own one of `param_ids`."""
    modules = list(modules)
    children = {id(child) for m in modules for child in m._modules.values() if child is not None}
    roots = []
    for module in modules:
        if id(module) in children:
            continue
        if any(id(p) in param_ids for p in module.parameters()):
            roots.append(module)
    return roots


def roots_in_memory(param_ids: set[int]) -> list[torch.nn.Module]:
    """The same search over every module the garbage collector knows: the fallback for modules
    built before msmon was loaded (`import msmon.auto` placed after the model)."""
    # type(), not isinstance(): isinstance asks a dead weak proxy for __class__ and raises
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.nn.Module)]
    return roots_owning(modules, param_ids)

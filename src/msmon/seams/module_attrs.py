"""A user's module's attributes as they are stored, read without running any of its code.

`getattr(module, "weight")` is not a read: on a parametrized module it runs the
parametrization's forward (spectral norm's power iteration updates its buffers in training
mode), a user's `weight` property may draw from the global RNG (a Bayesian layer), and a
module's own `__getattr__` may raise anything, not only AttributeError. Any of these would
change training or break the attach, so msmon looks into the module's storage instead:
its parameters, buffers, submodules, the original tensor behind a parametrization, and its
instance and class dictionaries (without calling descriptors).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_MISSING = object()


def stored(module: Any, name: str, default: Any = None) -> Any:
    """`module.name` as stored (a parameter, buffer, submodule or plain attribute), or `default`
    where reading it would run code (a property, `__getattr__`) or it does not exist."""
    for table in ("_parameters", "_buffers", "_modules"):
        entries = _own(module, table)
        if isinstance(entries, dict) and name in entries:
            return entries[name]
    try:
        value = inspect.getattr_static(module, name, _MISSING)
    except Exception:  # a metaclass or __dict__ that misbehaves: nothing readable
        return default
    if value is _MISSING or _is_descriptor(value):
        return default
    return value


def has_stored(module: Any, name: str) -> bool:
    """Whether `module` stores an attribute `name` (see `stored`)."""
    return stored(module, name, _MISSING) is not _MISSING


def stored_tensor(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The tensor `module.name` is stored as: the parameter or buffer itself, or, when `name`
    is parametrized, the one original it is computed from (None when it has several)."""
    value = stored(module, name)
    if isinstance(value, torch.Tensor):
        return value
    parametrizations = _own(module, "_modules")
    plist = parametrizations.get("parametrizations") if isinstance(parametrizations, dict) else None
    entry = _own(plist, "_modules").get(name) if isinstance(plist, torch.nn.ModuleDict) else None
    if entry is None:
        return None
    original = stored(entry, "original")
    return original if isinstance(original, torch.Tensor) else None


def _own(obj: Any, table: str) -> Any:
    """An entry of `obj`'s instance dictionary, read without `__getattr__` (empty if none)."""
    try:
        return vars(obj).get(table, {})
    except TypeError:  # no __dict__
        return {}


def _is_descriptor(value: Any) -> bool:
    """Whether reading the attribute would call code: a property or another descriptor (a plain
    function or staticmethod is not read as a value by msmon either)."""
    return hasattr(type(value), "__get__")

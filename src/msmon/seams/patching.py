"""Replacing a method on one object, and putting it back: the patching every instrumentor and
adapter shares (DeepSpeed's reduce calls, Megatron's bucket grad syncs, the `step` of an
optimizer that is no torch.optim.Optimizer); and a library's own entry points replaced once
per process (`Replacements`: deepspeed.initialize, Accelerator.prepare, Megatron's builders).

The undo holds neither the object nor the wrapper strongly, so a monitor that keeps the undo
never keeps a script's optimizer alive; it removes only its own wrapper (a later one stays).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable


def _hold_weakly(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # an object that cannot be referenced weakly is held as it is
        return lambda: obj


def _undo_of(obj: Any, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
    held, ours = _hold_weakly(obj), weakref.ref(wrapper)

    def undo() -> None:
        current, mine = held(), ours()
        if current is not None and mine is not None and current.__dict__.get(name) is mine:
            delattr(current, name)

    return undo


def wrap_method(
    obj: Any, name: str, before: Callable[..., None] | None = None, after: Callable[..., None] | None = None
) -> Callable[[], None]:
    """Replace obj.<name> on this instance only: `before(*args)` runs first, `after(result,
    *args)` last. Returns the undo. The class and other instances are untouched."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result

    setattr(obj, name, wrapper)
    return _undo_of(obj, name, wrapper)


def wrap_step(
    opt: Any,
    pre_hook: Callable[[Any, tuple, dict], tuple[tuple, dict] | None],
    post_hook: Callable[[Any, tuple, dict], None],
) -> Callable[[], None]:
    """Hook an optimizer that is not a torch.optim.Optimizer by wrapping its bound `step`, with
    torch's step-hook signatures (the pre-hook may return changed (args, kwargs)). Returns the undo."""
    original = opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        changed = pre_hook(opt, args, kwargs)  # args here exclude the optimizer
        if changed is not None:
            args, kwargs = changed
        result = original(*args, **kwargs)
        post_hook(opt, args, kwargs)
        return result

    opt.step = step
    return _undo_of(opt, "step", step)


class Replacements:
    """A library's attributes (a module's function, a class's method) replaced by msmon's
    wrappers, each at most once, and put back by `restore` (an instrumentor's uninstrument)."""

    __slots__ = ("_replaced",)

    def __init__(self) -> None:
        self._replaced: dict[tuple[int, str], tuple[Any, str, Any]] = {}

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> bool:
        """`owner.<name> = make(original)` unless it was replaced already; False then, or when
        `owner` has no such attribute."""
        original = getattr(owner, name, None)
        if original is None or (id(owner), name) in self._replaced:
            return False
        self._replaced[(id(owner), name)] = (owner, name, original)
        setattr(owner, name, make(original))
        return True

    def restore(self) -> None:
        for owner, name, original in self._replaced.values():
            setattr(owner, name, original)
        self._replaced.clear()

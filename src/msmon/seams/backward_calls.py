"""The scalar each backward pass starts from (the loss), seen without a change to the script.

While at least one listener is registered (the loss collector, the gradient agreement),
`torch.Tensor.backward` and `torch.autograd.backward` are wrapped process-wide: the outermost
call (Tensor.backward calls autograd.backward; one call is seen once) hands its tensor to the
listeners, once the pass has run, when it is one floating-point element, and says why not
otherwise (a listener tells from its own gradient hooks whether the pass reached its model: each
outermost call is announced to every listener before it runs, whatever its tensor, so a pass
that gives no loss leaves nothing behind for the next one). The value handed over is a copy
taken on the device at the call's entry (a one-element clone, no host read): the script may
write into its loss tensor after backward (an in-place all-reduce to log the average over
ranks), and the loss is what backward started from. The wrappers only read what they are
given; the call itself goes on unchanged. When the last listener leaves, every replaced
attribute is put back.

Loss scalers make the tensor backward runs on a scaled copy of the loss. The frameworks
declare theirs (`Framework.loss_scaling`, seams/spec.py):

- a scaler method returns `loss * scale` (torch's `GradScaler.scale`, DeepSpeed's
  `engine.scale`, Megatron's `scale_loss`): its result is remembered (weakly) with the very
  tensor it was given and the scale; a backward on that result is reported as the unscaled
  input, bit for bit the script's loss, with the scale beside it; nothing is divided and
  nothing is read on the host;
- an entry point receives the unscaled loss and calls backward on a scaled copy inside
  (DeepSpeed's `engine.backward`): the loss it receives is reported, and the backward calls
  inside it are not.

A scaler msmon is not told about (apex.amp's `scale_loss` context) cannot be told apart from a
loss: docs/loss.md says so.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .listeners import Listeners, Listening
from .patching import Replacements

#: on_loss(loss, scale): the unscaled loss (detached, as the script computed it) and the scale
#: the backward ran with (a tensor, or None when it was not scaled)
OnLoss = Callable[[torch.Tensor, "torch.Tensor | None"], None]
#: on_skipped(why): a backward pass that starts from no loss msmon can record
OnSkipped = Callable[[str], None]
#: on_start(): an outermost backward call (or entry point) is about to run
OnStart = Callable[[], None]


@dataclass(frozen=True)
class Scaler:
    """A method `owner.name(self, loss) -> loss * scale`; `scale_of(self)` the scale it used."""

    owner: type
    name: str
    scale_of: Callable[[Any], Any]


@dataclass(frozen=True)
class EntryPoint:
    """A method `owner.name(self, loss, ...)` that runs backward on a scaled copy of `loss`, or
    (`method=False`) a module's function `owner.name(loss, ...)` that runs backward itself."""

    owner: Any
    name: str
    method: bool = True


@dataclass(frozen=True)
class LossScaling:
    """What a framework scales losses with."""

    scalers: tuple[Scaler, ...] = ()
    entry_points: tuple[EntryPoint, ...] = ()


@dataclass
class _Listener:
    on_loss: OnLoss
    on_skipped: OnSkipped
    on_start: OnStart


class _State(threading.local):
    depth = 0  # backward calls (and entry points) running on this thread


_state = _State()
_declared: dict[tuple[int, str], Scaler | EntryPoint] = {}
# id(scaled tensor) -> (weak ref to it, the unscaled loss, the scale)
_scaled: dict[int, tuple[weakref.ref, torch.Tensor, Any]] = {}


def _forget_all() -> None:
    """The last listener left: no scaler is declared, no scaled loss remembered."""
    _declared.clear()
    _scaled.clear()


_registry: Listeners[_Listener] = Listeners(_forget_all)
_listeners = _registry.items  # the registered listeners, iterated over as a copy
_failure_said = False
logger = logging.getLogger("msmon")


def listen(
    on_loss: OnLoss,
    on_skipped: OnSkipped,
    scaling: Sequence[LossScaling] = (),
    on_start: OnStart = lambda: None,
) -> Listening:
    """Report every backward pass's loss to `on_loss` from now until `stop()`, and the start of
    every outermost call to `on_start`; `scaling`: the loss scalers of the frameworks in use
    (wrapped as well, once per process)."""

    def install(replaced: Replacements) -> None:
        replaced.replace(torch.Tensor, "backward", _wrap_tensor_backward)
        replaced.replace(torch.autograd, "backward", _wrap_autograd_backward)
        for declared in scaling:
            for scaler in declared.scalers:
                _replace_method(replaced, scaler, _wrap_scaler)
            for entry in declared.entry_points:
                _replace_method(replaced, entry, _wrap_entry_point)

    return _registry.add(_Listener(on_loss, on_skipped, on_start), install)


def _replace_method(replaced: Replacements, what: Scaler | EntryPoint, wrap: Callable[[Any, Any], Any]) -> None:
    key = (id(what.owner), what.name)
    if key not in _declared:
        _declared[key] = what
        replaced.replace(what.owner, what.name, lambda original: wrap(original, what))


def _loss_of(tensors: Any) -> tuple[torch.Tensor, Any] | None:
    """(unscaled loss, scale) of the outermost backward call's tensor(s), None when it has no
    loss (the listeners are told why)."""
    if isinstance(tensors, Sequence) and not isinstance(tensors, torch.Tensor):
        if len(tensors) != 1:
            _skipped("a backward call on several tensors at once (their sum is no one loss)")
            return None
        tensors = tensors[0]
    if not isinstance(tensors, torch.Tensor):
        return None  # a gradient edge: nothing to record
    tensor = tensors
    if tensor.numel() != 1 or not tensor.is_floating_point():
        if tensor.numel() != 1:
            _skipped("a backward call on a tensor of several elements, not a scalar loss")
        return None
    scale = None
    remembered = _scaled.get(id(tensor))
    if remembered is not None and remembered[0]() is tensor:
        _, loss, scale = remembered
    else:
        loss = tensor.detach()
    return loss.reshape(()).clone(), scale  # the value now: the script may write into its tensor later


def _skipped(why: str) -> None:
    for listener in list(_listeners):
        listener.on_skipped(why)


def _seen(tensors: Any) -> tuple[torch.Tensor, Any] | None:
    """The loss of the outermost call, read before it runs (a scaled tensor is looked up while
    it is alive), after every listener was told a call starts; a failure here must not stop
    the backward pass."""
    if _state.depth == 0 and _listeners:
        try:
            for listener in list(_listeners):
                listener.on_start()
            return _loss_of(tensors)
        except Exception as exc:  # contained: monitoring must never break training
            _failed(exc)
    return None


def _deliver(found: tuple[torch.Tensor, Any] | None) -> None:
    """After the backward pass: the listeners can tell whether it reached their parameters."""
    if found is None:
        return
    try:
        for listener in list(_listeners):
            listener.on_loss(*found)
    except Exception as exc:  # the listeners are guarded; this is for anything else
        _failed(exc)


def _failed(exc: Exception) -> None:
    global _failure_said
    if not _failure_said:
        _failure_said = True
        logger.error(
            "msmon: reading the loss of a backward call failed (%s: %s); the call goes on", type(exc).__name__, exc
        )


def _run(original: Callable[..., Any], tensors: Any, args: tuple, kwargs: dict) -> Any:
    found = _seen(tensors)
    _state.depth += 1
    try:
        result = original(*args, **kwargs)
    finally:
        _state.depth -= 1
    _deliver(found)
    return result


def _wrap_tensor_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _run(original, self, (self, *args), kwargs)

    return backward


def _wrap_autograd_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        return _run(original, args[0] if args else kwargs.get("tensors"), args, kwargs)

    return backward


def _wrap_scaler(original: Callable[..., Any], scaler: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: Any, outputs: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, outputs, *args, **kwargs)
        if (
            _listeners
            and isinstance(outputs, torch.Tensor)
            and isinstance(result, torch.Tensor)
            and result is not outputs
        ):
            key = id(result)
            # the entry goes with the scaled tensor (its id may be reused once it is gone)
            ref = weakref.ref(result, functools.partial(_forget, key))
            _scaled[key] = (ref, outputs.detach(), scaler.scale_of(self))
        return result

    return scale


def _forget(key: int, _ref: weakref.ref) -> None:
    _scaled.pop(key, None)


def _wrap_entry_point(original: Callable[..., Any], entry_point: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def entry(*args: Any, **kwargs: Any) -> Any:
        found = _seen(args[1 if entry_point.method else 0] if len(args) > int(entry_point.method) else None)
        _state.depth += 1  # its own backward calls run on a scaled copy: not reported
        try:
            result = original(*args, **kwargs)
        finally:
            _state.depth -= 1
        _deliver(found)
        return result

    return entry

"""What every optimizer adapter provides, and how wrappers are seen through.

An adapter answers, per model parameter (keyed by id): the weight the optimizer updates (an
fp32 master copy where there is one), the reduced gradient it consumes, and its Adam moments.
Families that split a parameter across data-parallel ranks (DeepSpeed ZeRO, Megatron's
distributed optimizer) answer with a `Shard`: this rank's piece, whose statistics are combined
with the other ranks' pieces at the end of the step (optimizers/shards.py).

Which rank writes a replicated tensor is decided once, at attach time (dedupe.py), and handed
to the adapter as `writer`: the public methods leave out what this rank does not write, so the
collectors never need to know about data or tensor parallelism.

Nothing here knows a framework: the adapters of each live in its package, `hooks/<framework>/`
(torch.optim's in `hooks/torch_optim/`), and seams/adapter_choice.py asks them in turn.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .patching import wrap_step

_WRAPPER_ATTRS = ("optimizer", "_optimizer")

GradPairs = list[tuple[torch.Tensor, torch.Tensor]]  # (model parameter, its gradient)


def unwrap_optimizer(optimizer: Any, drivers: frozenset[str] = frozenset()) -> Any:
    """The real optimizer under wrappers (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer, HF's wrappers): follow `.optimizer` / `._optimizer` while they lead to
    another object with `step` and `param_groups`. An optimizer whose class (or a base) is named
    in `drivers` (DeepSpeed's, Megatron's: each framework's `optimizer_classes`) is no wrapper:
    it is what is monitored, with the adapter of its family."""
    seen = set()
    current = optimizer
    while id(current) not in seen and drivers.isdisjoint(class_names(current)):
        seen.add(id(current))
        for attr in _WRAPPER_ATTRS:
            inner = getattr(current, attr, None)
            if inner is not None and inner is not current and hasattr(inner, "step") and hasattr(inner, "param_groups"):
                current = inner
                break
        else:
            break
    return current


def class_names(obj: Any) -> list[str]:
    """The names of obj's class and its bases, most derived first (dispatch by name lets the
    adapters work without importing DeepSpeed or Megatron)."""
    return [cls.__name__ for cls in type(obj).__mro__]


@dataclass
class Shard:
    """This rank's piece of a tensor split across `group` (empty when this rank holds none).

    Every rank of the group yields one for the same parameters in the same order, so their
    statistics can be combined with one collective per step; `write` says whether this rank
    writes the combined statistics."""

    local: torch.Tensor
    group: Any
    write: bool = True


@dataclass
class Moments:
    """Adam state of one parameter, as the optimizer holds it (tensors or Shards)."""

    exp_avg: Any
    exp_avg_sq: Any
    step: Any  # int, float or a (device) tensor
    beta1: float
    beta2: float
    eps: float


_reevaluations = [0]  # closures of a step now running again (LBFGS's line search), all optimizers


def in_closure_reevaluation() -> bool:
    """Whether a step closure is running for the second time or later: its forwards probe
    weights inside the update and are no micro-batch of the step."""
    return _reevaluations[0] > 0


class _ClosureOnce:
    """Wraps a step closure so the monitor sees the gradients right after it first runs
    (LBFGS and Lightning run forward/backward inside `step(closure)`); later runs are marked
    as re-evaluations so their forwards are not recorded as micro-steps."""

    def __init__(self, closure: Callable[[], Any], before: Callable[[], None]) -> None:
        self.closure = closure
        self.before = before
        self.fired = False

    def __call__(self) -> Any:
        if self.fired:
            _reevaluations[0] += 1
            try:
                return self.closure()
            finally:
                _reevaluations[0] -= 1
        result = self.closure()
        self.fired = True
        self.before()
        return result


def hook_optimizer_step(opt: Any, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
    """`before` once the gradients are final (after a step closure first ran), `after` once the
    update is applied: torch's step hooks on a torch.optim.Optimizer, a wrapped bound `step` on
    anything else (a framework's optimizer). Returns the undo."""

    def pre_hook(_opt: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # torch passes the optimizer itself as args[0]; a closure is a later callable
        if callable(kwargs.get("closure")):
            kwargs = dict(kwargs, closure=_ClosureOnce(kwargs["closure"], before))
            return args, kwargs
        for i, arg in enumerate(args):
            if arg is not _opt and callable(arg) and not hasattr(arg, "param_groups"):
                return args[:i] + (_ClosureOnce(arg, before),) + args[i + 1 :], kwargs
        before()
        return None

    def post_hook(_opt: Any, _args: tuple, _kwargs: dict) -> None:
        after()

    if isinstance(opt, torch.optim.Optimizer):
        handles = [opt.register_step_pre_hook(pre_hook), opt.register_step_post_hook(post_hook)]

        def remove() -> None:
            for handle in handles:
                handle.remove()

        return remove
    return wrap_step(opt, pre_hook, post_hook)


def adam_hyper(group: dict) -> tuple[float, float, float] | None:
    """(beta1, beta2, eps) of an Adam-like param group; None for optimizers without betas."""
    betas = group.get("betas")
    if betas is None:
        return None
    return float(betas[0]), float(betas[1]), float(group.get("eps", 1e-8))


def stepped_now(optimizer: Any) -> set[int]:
    """ids of the tensors a torch optimizer steps now: its param groups as its step pre-hook
    sees them (DeepSpeed narrows them to one group, or one ZeRO-3 sub-group, per inner step)."""
    return {id(t) for group in optimizer.param_groups for t in group["params"]}


def inner_moments(optimizer: Any, held: dict[int, int]) -> dict[int, Moments]:
    """Adam moments of a torch optimizer's params, keyed as `held` maps them: {id(param the
    optimizer holds): key}. Master-weight families map their fp32 copies to model params."""
    out: dict[int, Moments] = {}
    state = getattr(optimizer, "state", {})
    for group in optimizer.param_groups:
        hyper = adam_hyper(group)
        if hyper is None:
            continue
        for p in group["params"]:
            key = held.get(id(p))
            s = state.get(p) if key is not None else None
            if key is not None and s and "exp_avg" in s and "exp_avg_sq" in s:
                out[key] = Moments(s["exp_avg"], s["exp_avg_sq"], s.get("step", 1), *hyper)
    return out


class OptimizerGone(RuntimeError):
    """The optimizer a monitor was attached to has been garbage-collected."""


def hold_weakly(obj: Any) -> Callable[[], Any]:
    """A weak reference to `obj` (called, it gives obj or None once obj is gone); an object
    that cannot be referenced weakly is held as it is."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class OptimizerAdapter:
    """Family-specific access to an optimizer; see TorchOptimAdapter for the plain case.

    The optimizer is held weakly, so a monitor never keeps a script's optimizer (and its state)
    alive; `optimizer` raises OptimizerGone once it has been collected.

    Subclasses implement `params`, `_weights`, `_grads` and `_moments`; sharded families also
    `shard_groups`, and families whose gradients are taken away before autograd's hooks could
    read them also `hook_unreduced`; families that clip or unscale inside their own `step` and
    then step an inner torch optimizer also `consuming_optimizers` and `_consumed`. `hook_step`
    hooks the optimizer's own `step` (every family so far)."""

    family = "base"
    #: True when `hook_unreduced` reports the rank-local gradients before the data-parallel
    #: reduction (then nothing else reads them)
    hooks_unreduced = False
    #: set (at attach) when something reduces the gradients through `.data` (DeepSpeed's
    #: stage-0 engine), which leaves their version counters alone: each gradient is then handed
    #: out as a fresh view, so statistics read before the reduction are never reused for it
    reduced_through_data = False

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        # id() of the parameters whose replicated tensors another rank writes (decided once, at
        # attach: runtime/dedupe.py); a set, read per parameter and step without a call
        self.written_elsewhere: frozenset[int] = frozenset()

    @property
    def optimizer(self) -> Any:
        optimizer = self._optimizer()
        if optimizer is None:
            raise OptimizerGone(
                f"msmon: the {self.optimizer_name} this monitor was attached to has been "
                "garbage-collected; there is nothing more to record"
            )
        return optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Any) -> None:
        self.optimizer_name = type(optimizer).__name__
        self._optimizer = hold_weakly(optimizer)

    # -- what the collectors call ------------------------------------------------------------------
    def params(self) -> list[torch.Tensor]:
        """The model parameters this optimizer trains (on every rank the same list, sharded or not)."""
        raise NotImplementedError

    def weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        """The tensor reported as each parameter's weight, keyed by id(param): the parameter
        itself, an fp32 master copy, or a Shard of one."""
        return self._written(params, self._weights(params))

    def grads(
        self, params: list[torch.Tensor], grad_of: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> dict[int, Any]:
        """The gradient the optimizer consumes at step time, keyed by id(param)."""
        return self._written(params, self._grads(params, grad_of))

    def moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        """Adam moments keyed by id(param), for the params that have them."""
        return self._written(params, self._moments(params))

    def own_weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        """This rank's own copy of each weight, whichever rank writes it (the replica check
        compares every rank's copy)."""
        return self._weights(params)

    def own_grads(
        self, params: list[torch.Tensor], grad_of: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> dict[int, Any]:
        """This rank's own reduced gradients, whichever rank writes them."""
        return self._grads(params, grad_of)

    def holds_moments(self, params: list[torch.Tensor]) -> bool:
        """Whether the optimizer keeps Adam moments for any of `params`, whichever rank writes them."""
        return bool(self._moments(params))

    def hook_step(self, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
        """Call `before` once the gradients are final (after a closure ran) and `after` once the
        update is applied. Returns a function that removes the hooks."""
        return hook_optimizer_step(self.optimizer, before, after)

    def consuming_optimizers(self) -> list[Any]:
        """The torch optimizers that this optimizer's own `step()` drives after it clipped or
        unscaled the gradients (DeepSpeed's and Megatron's inner AdamW): the gradients they
        consume are read in their step pre-hooks (`consumed_grads`). Empty here: the gradients
        are final when `step()` is entered."""
        return []

    def consumed_grads(self, params: list[torch.Tensor], stepping: Any) -> dict[int, Any]:
        """In a step pre-hook of `stepping` (one of `consuming_optimizers()`): the gradient it is
        about to consume for each of `params` it steps now, keyed by id(param), as `grads`
        gives them (Shards where split; replicated ones only where this rank writes them).
        A framework may step its inner optimizer once per parameter group: each call answers
        for the parameters of the groups stepped then."""
        return self._written(params, self._consumed(params, stepping))

    def hook_unreduced(
        self, models: list[torch.nn.Module], record: Callable[[GradPairs], None]
    ) -> Callable[[], None] | None:
        """Call `record` with the rank-local gradients right before each data-parallel
        reduction (a bucket's grad sync). None: this family has no such point."""
        return None

    def shard_groups(self) -> list[Any]:
        """The process groups across which this optimizer splits parameters (none here)."""
        return []

    def shard_group(self, param: torch.Tensor) -> Any:
        """The group `param` is split across, or None when this rank holds all of it."""
        return None

    def replica_group(self, param: torch.Tensor) -> Any:
        """The group across which `param`'s pieces are copies (HSDP: split across the shard
        group, replicated across this one), or None. The replica check compares this rank's
        piece (the Shard its weights and gradients are) across it."""
        return None

    def unreplicated(self, param: torch.Tensor) -> str | None:
        """Why this rank's piece of `param` has a copy on no other rank (split, and replicated
        across no group), for the replica check; None when this adapter knows no such reason."""
        return None

    def named_params(self, params: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Per model chunk, {name: parameter} as the monitor reports them: the model's own,
        unless the optimizer trains stand-ins (FSDP1's flat parameters, one for several)."""
        return params

    def data_parallel_group(self) -> Any:
        """The data-parallel group the optimizer itself knows, or None."""
        return None

    # -- family-specific -----------------------------------------------------------------------------
    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        return {id(p): p for p in params}

    def _grads(
        self, params: list[torch.Tensor], grad_of: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> dict[int, Any]:
        out = {}
        for p in params:
            g = grad_of(p)
            if g is not None:
                out[id(p)] = g.view_as(g) if self.reduced_through_data else g
        return out

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        raise NotImplementedError

    def _consumed(self, params: list[torch.Tensor], stepping: Any) -> dict[int, Any]:
        return {}

    def _written(self, params: list[torch.Tensor], values: dict[int, Any]) -> dict[int, Any]:
        """Leave out the replicated tensors another rank writes. Shards stay (every rank's
        piece is needed for the combined statistics); they only carry whether this rank writes."""
        out = {}
        for p in params:
            value = values.get(id(p))
            if value is None:
                continue
            writes = id(p) not in self.written_elsewhere
            if _has_shard(value):
                _mark_written(value, writes)
                out[id(p)] = value
            elif writes:
                out[id(p)] = value
        return out


def _has_shard(value: Any) -> bool:
    if isinstance(value, Moments):
        return isinstance(value.exp_avg, Shard)
    return isinstance(value, Shard)


def _mark_written(value: Any, writes: bool) -> None:
    for shard in (value.exp_avg, value.exp_avg_sq) if isinstance(value, Moments) else (value,):
        if isinstance(shard, Shard):
            shard.write = writes


class TorchOptimAdapter(OptimizerAdapter):
    """torch.optim optimizers (any subclass, including user-defined ones): the parameters are
    what the optimizer steps, gradients their `.grad`, moments its `state`. The fallback adapter,
    for any optimizer no framework package claims (hooks/torch_optim), and the base of framework
    adapters that read a plain torch optimizer underneath (fsdp's, megatron's chained parts)."""

    family = "torch"

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        return inner_moments(self.optimizer, {id(p): id(p) for p in params})

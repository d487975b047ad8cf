"""torch.optim optimizers (any subclass, including user-defined ones)."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .base import Moments, OptimizerAdapter, hold_weakly

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


class TorchOptimAdapter(OptimizerAdapter):
    family = "torch"

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        return inner_moments(self.optimizer, {id(p): id(p) for p in params})

    def hook_step(self, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
        opt = self.optimizer

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
            return lambda: [h.remove() for h in handles]
        return _wrap_step_method(opt, pre_hook, post_hook)


def adam_hyper(group: dict) -> tuple[float, float, float] | None:
    """(beta1, beta2, eps) of an Adam-like param group; None for optimizers without betas."""
    betas = group.get("betas")
    if betas is None:
        return None
    return float(betas[0]), float(betas[1]), float(group.get("eps", 1e-8))


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
            if s and "exp_avg" in s and "exp_avg_sq" in s:
                out[key] = Moments(s["exp_avg"], s["exp_avg_sq"], s.get("step", 1), *hyper)
    return out


def _wrap_step_method(opt: Any, pre_hook: Callable, post_hook: Callable) -> Callable[[], None]:
    """Hook an optimizer that is not a torch.optim.Optimizer by wrapping its bound `step`."""
    original = opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        changed = pre_hook(opt, args, kwargs)  # args here exclude the optimizer
        if changed is not None:
            args, kwargs = changed
        result = original(*args, **kwargs)
        post_hook(opt, args, kwargs)
        return result

    opt.step = step
    # the undo must not keep the optimizer alive, nor the wrapper (which holds it; the optimizer holds the wrapper)
    held, wrapper = hold_weakly(opt), weakref.ref(step)

    def remove() -> None:
        current, ours = held(), wrapper()
        if current is not None and ours is not None and current.__dict__.get("step") is ours:
            del current.step

    return remove

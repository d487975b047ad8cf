"""Target selection: which modules and parameters of the model the config's targets name.

Pure functions of the model chunks, the config and the optimizer adapter, used when the
monitor attaches, when an edited config is checked, and when collectors are built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .config import ConfigError, MonitorConfig, TensorSpec
from .naming import check_targets as _check_names
from .naming import covers, display, split_vpp

logger = logging.getLogger("msmon")

Names = tuple[list[dict[str, torch.nn.Module]], list[dict[str, torch.nn.Parameter]]]


@dataclass
class MonitoredParam:
    """A parameter the monitor watches, with the name it is reported under."""

    name: str
    vpp_stage: int
    param: torch.nn.Parameter


def names(models: list[torch.nn.Module], squash: bool) -> Names:
    """Per chunk: {display name: module}, {display name: parameter}."""
    modules = [{display(n, squash): m for n, m in chunk.named_modules()} for chunk in models]
    params = [{display(n, squash): p for n, p in chunk.named_parameters()} for chunk in models]
    return modules, params


def check_targets(config: MonitorConfig, models: list[torch.nn.Module]) -> None:
    """ConfigError unless every target of `config` names a module or parameter of the model."""
    from .collectors.l2_features.targets import resolve_targets

    modules, params = names(models, config.squash_name)
    _check_names(config.targets, [set(m) for m in modules], [set(p) for p in params])
    if config.recording_l2_features:
        resolve_targets(config, modules)  # l2_targets naming no module: a ConfigError here too


def targets_for(config: MonitorConfig, chunk: int) -> list[str]:
    """The targets that apply to model chunk `chunk` (without their `vpp:` prefix)."""
    out = []
    for target in config.targets:
        vpp, name = split_vpp(target)
        if vpp is None or vpp == chunk:
            out.append(name)
    return out


def monitored_params(
    config: MonitorConfig, models: list[torch.nn.Module], adapter: Any, rank: int
) -> list[MonitoredParam]:
    """The parameters the targets cover that the optimizer owns, each once."""
    owned = {id(p) for p in adapter.params()}
    _, params = names(models, config.squash_name)
    params = adapter.named_params(params)  # FSDP1's flat parameters: several originals each
    chosen: list[MonitoredParam] = []
    seen: set[int] = set()
    for chunk, named in enumerate(params):
        targets = targets_for(config, chunk) or [""]
        for name, p in named.items():
            if id(p) in seen or (owned and id(p) not in owned):
                continue
            if any(covers(t, name) for t in targets):
                seen.add(id(p))
                chosen.append(MonitoredParam(name, chunk, p))
    cfg = config
    if not chosen and (cfg.wg_distribution or cfg.param_distribution or cfg.mv_distribution or cfg.ur_distribution):
        reason = (
            "no parameter matches the targets"
            if any(id(p) in owned for named in params for p in named.values())
            else "the optimizer owns no parameter of the given model"
        )
        logger.warning("msmon[rank %d]: %s; weights, gradients and moments are not recorded", rank, reason)
    return chosen


def decide_main_grad(params: list[MonitoredParam], params_have_main_grad: bool | None) -> bool:
    """Whether gradients are read from `main_grad` (Megatron's buffer) rather than `.grad`."""
    has_main = any(hasattr(mp.param, "main_grad") for mp in params)
    if params_have_main_grad is None:
        return has_main
    if params_have_main_grad and params and not has_main:
        raise ConfigError(
            "params_have_main_grad=True, but the model's parameters have no `main_grad` "
            "attribute (that is Megatron's gradient buffer); pass params_have_main_grad=False "
            "or leave it out to detect it"
        )
    return bool(params_have_main_grad)


def recorded_modules(named: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """The modules of a chunk whose calls are recorded: all but the root, whose call is the
    whole model's (its input the batch); the root too when it is the only module (a model that
    is one nn.Linear), else nothing would be. msprobe's all_xy records the root always, named
    by the empty string as here."""
    if len(named) == 1:
        return dict(named)
    return {name: module for name, module in named.items() if name != ""}


def xy_targets(
    config: MonitorConfig, modules: list[dict[str, torch.nn.Module]]
) -> list[tuple[torch.nn.Module, str, int, int, dict[str, TensorSpec]]]:
    """(module, name, vpp stage, chunk, tensor specs) of every module whose activations are recorded."""
    cfg = config
    out = []
    for chunk, named in enumerate(modules):
        targets = {
            name: cfg.targets.get(t, {}) for t in cfg.targets for v, name in [split_vpp(t)] if v is None or v == chunk
        }
        select_all = cfg.all_xy or "" in targets or not cfg.targets
        for name, module in recorded_modules(named).items():
            if select_all or name in targets:
                out.append((module, name, chunk, chunk, targets.get(name, {})))
    return out

"""Target selection: which modules and parameters of the model the config's targets name.

Pure functions of the model chunks, the config and the optimizer adapter, used when the
monitor attaches, when an edited config is checked, and when collectors are built. Targets
match whole name components: `layers.1` takes `layers.1.fc.weight`, never `layers.10.fc.weight`;
`"1:layers.0"` names a module of virtual-pipeline chunk 1 only.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import ConfigError, MonitorConfig, TensorSpec
from ..system.short_repr import short_repr
from .naming import display

logger = logging.getLogger("msmon")

Names = tuple[list[dict[str, torch.nn.Module]], list[dict[str, torch.nn.Parameter]]]
# a collector's check of the config against the model's modules (per chunk: {display name: module})
ModuleCheck = Callable[[MonitorConfig, list[dict[str, torch.nn.Module]]], None]


@dataclass
class MonitoredParam:
    """A parameter the monitor watches, with the name it is reported under."""

    name: str
    vpp_stage: int
    param: torch.nn.Parameter


def covers(target: str, name: str) -> bool:
    """Whether a target names `name` or one of its ancestors, by whole components."""
    return target == "" or name == target or name.startswith(target + ".")


def split_vpp(target: str) -> tuple[int | None, str]:
    """`"1:layers.0"` -> (1, "layers.0"); plain names apply to every chunk."""
    match = re.fullmatch(r"(\d+):(.*)", target)
    return (int(match.group(1)), match.group(2)) if match else (None, target)


def check_names(targets: Iterable[str], module_names: list[set[str]], param_names: list[set[str]]) -> None:
    """Every target must name a module or parameter of the model; else list the closest names."""
    everything = sorted(set().union(*module_names, *param_names) - {""})
    for target in targets:
        if target == "":
            continue
        vpp, name = split_vpp(target)
        chunks = range(len(module_names)) if vpp is None else [vpp]
        found = any(0 <= c < len(module_names) and (name in module_names[c] or name in param_names[c]) for c in chunks)
        if not found:
            close = difflib.get_close_matches(name, everything, n=5, cutoff=0.4)
            if not close:
                prefix = name.split(".")[0]
                close = [n for n in everything if n.startswith(prefix)][:5] or everything[:5]
            raise ConfigError(
                f"targets: {short_repr(target)} names no module or parameter of the model; "
                f"closest names: {', '.join(close)}"
            )


def names(models: list[torch.nn.Module], squash: bool) -> Names:
    """Per chunk: {display name: module}, {display name: parameter}."""
    modules = [{display(n, squash): m for n, m in chunk.named_modules()} for chunk in models]
    params = [{display(n, squash): p for n, p in chunk.named_parameters()} for chunk in models]
    return modules, params


def check_targets(
    config: MonitorConfig, models: list[torch.nn.Module], module_checks: Sequence[ModuleCheck] = ()
) -> None:
    """ConfigError unless every target of `config` names a module or parameter of the model,
    and each of `module_checks` (the collectors' own target checks, passed down by the api:
    l2_targets naming no module is a ConfigError too) accepts the config."""
    modules, params = names(models, config.squash_name)
    check_names(config.targets, [set(m) for m in modules], [set(p) for p in params])
    everything = sorted({name for chunk in modules for name in recorded_modules(chunk)} - {""})
    for part in config.xy_name_contains:
        if not any(part in name for name in everything):
            close = difflib.get_close_matches(part, everything, n=5, cutoff=0.4) or everything[:5]
            raise ConfigError(
                f"xy_name_contains: no module name contains {short_repr(part)}; module names: {', '.join(close)}"
            )
    for check in module_checks:
        check(config, modules)


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
        select_all = cfg.all_xy or "" in targets or not (cfg.targets or cfg.xy_name_contains)
        for name, module in recorded_modules(named).items():
            if select_all or name in targets or any(part in name for part in cfg.xy_name_contains):
                out.append((module, name, chunk, chunk, targets.get(name, {})))
    return out

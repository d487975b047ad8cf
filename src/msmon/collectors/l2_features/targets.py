"""Which modules the L2 features hook: `l2_targets` resolved against the model, with a
ConfigError naming the closest module for a name that matches none. Torch and the config only:
the attach checks, the target selection and the collector all ask it."""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING

import torch

from ...config import ConfigError, MonitorConfig
from ...runtime.naming import display
from ...runtime.selection import split_vpp
from ...seams.module_attrs import has_stored, stored_tensor
from ...stats.inputs import local_tensor

if TYPE_CHECKING:
    from ...runtime.step_context import StepContext

_WEIGHT_NAMES = ("weight", "wg")  # msprobe's: nn.Linear and most routers hold `weight`, some `wg`


def weight_2d(module: torch.nn.Module) -> torch.Tensor | None:
    """The module's own 2-D `weight` (or `wg`), as msprobe's linear hook takes it, as stored
    (module_attrs: a parametrization's original, never a computed value); this rank's shard
    of a DTensor."""
    for attr in _WEIGHT_NAMES:
        value = stored_tensor(module, attr)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return local_tensor(value)
    return None


def _is_embedding(module: torch.nn.Module) -> bool:
    return (
        isinstance(module, torch.nn.Embedding)
        or has_stored(module, "num_embeddings")
        or has_stored(module, "vocab_start_index")
    )


def resolve_targets(
    cfg: MonitorConfig, modules: list[dict[str, torch.nn.Module]]
) -> list[tuple[str, torch.nn.Module, str, int]]:
    """(hook, module, name, chunk) for every l2_targets entry; a name that matches no module,
    or a weight hook on a module without a 2-D weight, is a ConfigError naming the closest."""
    everything = sorted(set().union(*(set(m) for m in modules)) - {""})
    out: list[tuple[str, torch.nn.Module, str, int]] = []
    for hook, names in cfg.l2_targets.items():
        weighted = hook in ("linear_hook", "moe_router_weight_hook")
        if hook == "linear_hook" and not names:  # every module with a 2-D weight
            out.extend(
                (hook, m, n, c)
                for c, named in enumerate(modules)
                for n, m in named.items()
                if n and weight_2d(m) is not None and not _is_embedding(m)
            )
            continue
        for target in names:
            vpp, name = split_vpp(target)
            chunks = range(len(modules)) if vpp is None else [vpp]
            found = [(c, modules[c][name]) for c in chunks if 0 <= c < len(modules) and name in modules[c]]
            if not found:
                close = difflib.get_close_matches(name, everything, n=5, cutoff=0.4) or everything[:5]
                raise ConfigError(
                    f"l2_targets[{hook!r}]: {target!r} names no module of the model; closest names: {', '.join(close)}"
                )
            for chunk, module in found:
                if weighted and weight_2d(module) is None:
                    raise ConfigError(
                        f"l2_targets[{hook!r}]: {target!r} ({type(module).__name__}) has no 2-D "
                        f"`weight` or `wg` to compute its features from"
                    )
                out.append((hook, module, name, chunk))
    return out


def l2_targets_error(cfg: MonitorConfig, chunks: list[torch.nn.Module]) -> ConfigError | None:
    """Why `l2_targets` do not fit the model made of `chunks` (None: they do, or L2 features are off)."""
    if not cfg.recording_l2_features:
        return None
    try:
        resolve_targets(cfg, [{display(n, cfg.squash_name): m for n, m in chunk.named_modules()} for chunk in chunks])
    except ConfigError as exc:
        return exc
    return None


def l2_targets_nowhere(
    cfg: MonitorConfig, roots: list[torch.nn.Module], others: list[torch.nn.Module]
) -> ConfigError | None:
    """The error of the first l2_targets entry that fits neither the model of `roots` nor any of
    the `others` (models the process built): the job's mistake, not another optimizer's model."""
    for hook, names in cfg.l2_targets.items():
        for name in names or [""]:
            one = dataclasses.replace(cfg, l2_targets={hook: [name] if name else []})
            error = l2_targets_error(one, roots)
            if error is not None and all(l2_targets_error(one, [m]) is not None for m in others):
                return error
    return None


def l2_targets_fit(cfg: MonitorConfig, modules: list[dict[str, torch.nn.Module]]) -> None:
    """ConfigError when l2_targets names no module of the model (checked at attach and on a
    reload, whether the collector is built or not)."""
    if cfg.recording_l2_features:
        resolve_targets(cfg, modules)


def l2_enabled(cfg: MonitorConfig, ctx: StepContext) -> bool:
    """Whether l2_targets name any module (a name that matches none is a ConfigError)."""
    return cfg.recording_l2_features and bool(resolve_targets(cfg, ctx.names()[0]))

"""Model chunks, the names modules and parameters are reported under, and target matching.

Wrapper prefixes (DDP's `module.`, torch.compile's `_orig_mod.`, FSDP/checkpoint wrappers,
Lightning's `_forward_module.`) are removed so names are the user's own, whatever wraps the
model. Targets match whole name components: `layers.1` takes `layers.1.fc.weight`, never
`layers.10.fc.weight`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

import torch

from ..config import ConfigError
from ..system.short_repr import short_repr

WRAPPER_COMPONENTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module")
_SQUASH = re.compile(
    r"^.*?\.?((?:layers?|embeddings?|embedding|final_layernorm|output_layer|decoder|encoder)(?:\..*)?)$"
)


def model_chunks(model: Any) -> list[torch.nn.Module]:
    """A model or a list of virtual-pipeline chunks, as a list."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"msmon: expected a torch.nn.Module or a list of them, got {type(chunk).__name__}")
    return chunks


def clean_name(name: str) -> str:
    """Drop wrapper components from a dotted module/parameter name."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    return ".".join(parts)


def squash(name: str) -> str:
    """Shorten long framework prefixes (`module.language_model.encoder.layers.0...` ->
    `layers.0...`), as msprobe's squash_name does."""
    match = _SQUASH.match(name)
    return match.group(1) if match else name


def display(name: str, squash_names: bool) -> str:
    name = clean_name(name)
    return squash(name) if squash_names else name


def covers(target: str, name: str) -> bool:
    """Whether a target names `name` or one of its ancestors, by whole components."""
    return target == "" or name == target or name.startswith(target + ".")


def split_vpp(target: str) -> tuple[int | None, str]:
    """`"1:layers.0"` -> (1, "layers.0"); plain names apply to every chunk."""
    match = re.fullmatch(r"(\d+):(.*)", target)
    return (int(match.group(1)), match.group(2)) if match else (None, target)


def check_targets(targets: Iterable[str], module_names: list[set[str]], param_names: list[set[str]]) -> None:
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

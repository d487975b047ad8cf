"""Model chunks and the names modules and parameters are reported under.

Wrapper prefixes (DDP's `module.`, torch.compile's `_orig_mod.`, FSDP/checkpoint wrappers,
Lightning's `_forward_module.`) are removed so names are the user's own, whatever wraps the
model. Which names the config's targets take is selection.py's.
"""

from __future__ import annotations

import re
from typing import Any

import torch

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

"""The framework packages, in the order they are asked, and the import that switches each on.

The order is the order of the answers: most specific first, so torch_optim, whose adapter fits
any optimizer, comes after the frameworks built on torch.optim (Megatron, DeepSpeed, FSDP).
To add a framework: write its folder `hooks/<name>/`, whose `__init__.py` exports a
`Framework` as `FRAMEWORK` (hooks/core/spec.py), and add its line here.

The packages are imported by name when first asked (a light import: none imports its
library), so this module, below the instrumentors, never imports one of them by itself."""

from __future__ import annotations

import functools
import importlib

from .spec import Framework

PACKAGE = "msmon.hooks"

SWITCHED_ON_BY: dict[str, str] = {
    # package (folder of hooks/)   the import that switches it on
    "megatron": "megatron.core",
    "deepspeed": "deepspeed",
    "fsdp": "torch.distributed.fsdp",
    "torch_optim": "torch",
    "torch_distributed": "torch",
}


def load(name: str) -> Framework:
    """The spec exported by package `hooks/<name>/` (imports it: ImportError when it cannot be)."""
    spec = importlib.import_module(f"{PACKAGE}.{name}").FRAMEWORK
    if not isinstance(spec, Framework):
        raise TypeError(f"{PACKAGE}.{name}.FRAMEWORK is a {type(spec).__name__}, not a Framework")
    return spec


@functools.cache
def frameworks() -> tuple[Framework, ...]:
    """Every registered framework's spec, in the registry's order."""
    return tuple(load(name) for name in SWITCHED_ON_BY)

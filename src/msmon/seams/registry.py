"""The framework packages, found in the hooks folder, in the order they are asked.

Every sub-package of msmon.hooks is a framework package: its light `__init__.py`
exports a `Framework` as `FRAMEWORK` (seams/spec.py), which says the import that switches
it on and its place in the order (`precedence`: most specific first, so torch_optim, whose
adapter fits any optimizer, comes after the frameworks built on torch.optim). To add a
framework, write its folder `hooks/<name>/`: nothing else names it.

The packages are imported by name when first asked (a light import: none imports its
library), so this module, below the instrumentors, never imports one of them by itself."""

from __future__ import annotations

import functools
import importlib
import logging
import pkgutil

from ..system.distributed import current_rank
from .spec import Framework

logger = logging.getLogger("msmon")

PACKAGE = "msmon.hooks"


def package_names() -> list[str]:
    """The framework packages in the hooks folder (its sub-packages), by name."""
    hooks = importlib.import_module(PACKAGE)  # already imported: this module is inside it
    found = pkgutil.iter_modules(hooks.__path__)
    return sorted(module.name for module in found if module.ispkg)


def load(name: str) -> Framework:
    """The spec exported by package `hooks/<name>/` (imports it: ImportError when it cannot be,
    TypeError when it exports no Framework)."""
    package = importlib.import_module(f"{PACKAGE}.{name}")
    if not hasattr(package, "FRAMEWORK"):
        raise TypeError(f"{PACKAGE}.{name} exports no FRAMEWORK (a Framework: seams/spec.py)")
    spec = package.FRAMEWORK
    if not isinstance(spec, Framework):
        raise TypeError(f"{PACKAGE}.{name}.FRAMEWORK is a {type(spec).__name__}, not a Framework")
    return spec


@functools.cache
def frameworks() -> tuple[Framework, ...]:
    """Every framework package's spec, in the order they are asked: by precedence, ties by name.
    A package that cannot be imported, or exports no Framework, is reported (once: the answer is
    kept) and left out, and the others go on."""
    specs = []
    for name in package_names():
        try:
            specs.append(load(name))
        except Exception as exc:
            logger.error(
                "msmon[rank %d]: instrumentor %s.%s cannot be imported: %r", current_rank(), PACKAGE, name, exc
            )
    return tuple(sorted(specs, key=lambda spec: (spec.precedence, spec.name)))

"""What Inductor generated for msmon's compiled statistics: how many kernels one call launches.

A compiled call launches its kernels outside the dispatcher, where no TorchDispatchMode counts
them; benchmarks/op_counts.py counts kernels, not Python calls ("a wrapper around several
kernels counts as those kernels"), so the count is read from the `call` function of the code
modules Inductor loaded for the graph: each C++ kernel, Triton kernel or extern op it invokes.
"""

from __future__ import annotations

import inspect
import re
from typing import Any


def loaded_modules() -> set[int]:
    """The code modules Inductor has loaded in this process (ids): taken before and after a
    first call, their difference is that call's graph."""
    from torch._inductor.codecache import PyCodeCache

    return {id(module) for module in _code_modules(PyCodeCache)}


def _code_modules(cache: Any) -> list[Any]:
    modules = getattr(cache, "modules", None)
    if isinstance(modules, dict):
        return list(modules.values())
    return list(modules or [])


# a kernel launched by Inductor's generated `call`: a C++ kernel, a Triton kernel, an extern op
_LAUNCH = re.compile(r"^\s*(?:\w+ = )?(cpp_fused_\w+|\w+\.run|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?)\(", re.M)


def kernels_in(new_modules: set[int]) -> int:
    """Kernel launches in the `call` of the code modules Inductor loaded for one graph."""
    from torch._inductor.codecache import PyCodeCache

    count = 0
    for module in _code_modules(PyCodeCache):
        if id(module) in new_modules and hasattr(module, "call"):
            try:
                count += len(_LAUNCH.findall(inspect.getsource(module.call)))
            except (OSError, TypeError):
                continue
    return count or 1

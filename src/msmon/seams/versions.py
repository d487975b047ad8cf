"""Whether the installed version of an instrumented library is one msmon was built and tested
against: checked once when its instrumentor switches on, a warning when it is not (monitoring
goes on; an unknown version says nothing).

A range is a comma-separated list of clauses such as ">=0.17,<0.20"; versions compare by their
numeric release part (`2.13.0+cpu` is 2.13.0, `0.16.1rc0` is 0.16.1).
"""

from __future__ import annotations

import importlib.metadata
import logging
import operator
import re
import sys
from typing import Callable

from ..system.distributed import current_rank

logger = logging.getLogger("msmon")

_OPERATORS: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*$")
_warned: set[str] = set()  # distributions already warned about: one warning each


def release(version: str) -> tuple[int, ...]:
    """The numeric release part of a version string, e.g. (2, 13, 0) for "2.13.0+cpu"."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in found.group(0).split(".")) if found else ()


def in_range(version: str, supported: str) -> bool:
    """Whether `version` satisfies every clause of `supported` (">=0.17,<0.20")."""
    mine = release(version)
    for clause in filter(None, (c.strip() for c in supported.split(","))):
        parsed = _CLAUSE.match(clause)
        if parsed is None:
            raise ValueError(f"not a version clause: {clause!r} in {supported!r}")
        op, bound = _OPERATORS[parsed.group(1)], release(parsed.group(2))
        width = max(len(mine), len(bound))
        if not op(mine + (0,) * (width - len(mine)), bound + (0,) * (width - len(bound))):
            return False
    return True


def installed(distribution: str, module: str | None = None) -> str | None:
    """The installed version of `distribution`, else `module.__version__`, else None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules.get(module or distribution), "__version__", None)
        return str(version) if version is not None else None


def warn_if_unsupported(distribution: str, supported: str, module: str | None = None) -> bool:
    """Log one warning when the installed `distribution` is outside `supported`; never raises.
    Returns whether it is outside."""
    try:
        version = installed(distribution, module)
        outside = version is not None and not in_range(version, supported)
    except Exception as exc:  # a check of ours must never stop monitoring
        logger.debug("msmon: could not check the version of %s: %r", distribution, exc)
        return False
    if outside and distribution not in _warned:
        _warned.add(distribution)
        logger.warning(
            "msmon[rank %d]: %s %s is outside the versions msmon supports (%s); monitoring it anyway, "
            "but what msmon reads of it may be wrong or missing",
            current_rank(),
            distribution,
            version,
            supported,
        )
    return outside

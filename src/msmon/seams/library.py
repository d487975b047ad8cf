"""A framework's own library, imported by name where a framework package needs it.

The instrumented libraries (DeepSpeed, Megatron, accelerate, the next one) mostly ship no type
information, and may be absent where msmon is type-checked. Imported by name, each is a module
whose attributes are Any to mypy, so a new framework needs no line of its own in pyproject.toml's
mypy overrides. It is imported when called: a framework package's `__init__.py` never imports
its library."""

from __future__ import annotations

import importlib
from typing import Any


def library(name: str) -> Any:
    """The module `name` ("deepspeed", "megatron.core.parallel_state"), imported now if it was
    not yet (ImportError when it is not installed)."""
    return importlib.import_module(name)

"""msmon: a lightweight training-state monitor for PyTorch, msprobe-compatible.

`import msmon` imports no torch (the `msmon` launcher and the job bootstrap import it), so its
exports are imported on first use. Type checkers read `__init__.pyi`, which declares them as
plain re-exports; `from msmon import TrainerMon` and `from msmon.api import TrainerMon` are
the same class.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["TrainerMon", "ConfigError", "MonitorConfig", "load_config", "__version__"]
_EXPORTS = {"TrainerMon": ".api", "ConfigError": ".config", "MonitorConfig": ".config", "load_config": ".config"}


def __getattr__(name: str) -> Any:
    """Import on first use, so the `msmon` launcher and the bootstrap never import torch."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'msmon' has no attribute {name!r}")

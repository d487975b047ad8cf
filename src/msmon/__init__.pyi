# What type checkers see of `msmon`: its exports, statically. At run time `msmon/__init__.py`
# imports them on first use (importing `msmon` must not import torch: the launcher and the
# bootstrap import it); this stub keeps that laziness invisible to mypy, pyright and IDEs.
from .api import TrainerMon as TrainerMon
from .config import ConfigError as ConfigError
from .config import MonitorConfig as MonitorConfig
from .config import load_config as load_config

__version__: str
__all__ = ["TrainerMon", "ConfigError", "MonitorConfig", "load_config", "__version__"]

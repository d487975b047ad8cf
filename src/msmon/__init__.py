"""msmon: a lightweight training-state monitor for PyTorch, msprobe-compatible."""
from .config import ConfigError, MonitorConfig, load_config
from .monitor import TrainerMon

__version__ = "0.1.0"
__all__ = ["TrainerMon", "ConfigError", "MonitorConfig", "load_config", "__version__"]

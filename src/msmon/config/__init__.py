"""The monitor config: read a JSON or YAML file, validate every key before training starts.

Callers import from `msmon.config`; the modules below it are `parsing` (the keys and their
validation) and `text` (a file's bytes to a mapping). Never imports torch.
"""

from .parsing import (
    ALERT_RULES,
    FORMATS,
    L2_HOOKS,
    MSPROBE_ONLY_KEYS,
    SA_ORDERS,
    TARGET_SLOTS,
    VALID_KEYS,
    AlertConfig,
    AlertRuleConfig,
    CCConfig,
    ConfigError,
    MonitorConfig,
    ReplicaCheckConfig,
    TensorSpec,
    load_config,
    parse_config,
    parse_ops,
    read_config_file,
)

__all__ = [
    "ALERT_RULES",
    "FORMATS",
    "L2_HOOKS",
    "MSPROBE_ONLY_KEYS",
    "SA_ORDERS",
    "TARGET_SLOTS",
    "VALID_KEYS",
    "AlertConfig",
    "AlertRuleConfig",
    "CCConfig",
    "ConfigError",
    "MonitorConfig",
    "ReplicaCheckConfig",
    "TensorSpec",
    "load_config",
    "parse_config",
    "parse_ops",
    "read_config_file",
]

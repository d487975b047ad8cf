"""The monitor config: read a JSON or YAML file, validate every key before training starts.

Callers import from `msmon.config`; below it, `errors` holds ConfigError, `schema` declares every
key once (name, type, default, doc line), `parsing` validates a mapping against it and loads a
file, and `text` turns a file's bytes into a mapping (encoding, full-width punctuation, the YAML
alias bound). Never imports torch.
"""

from .errors import ConfigError, did_you_mean
from .parsing import load_config, parse_config, parse_ops, read_config_file
from .schema import (
    ALERT_RULES,
    L2_HOOKS,
    MSPROBE_ONLY_KEYS,
    SA_ORDERS,
    TARGET_SLOTS,
    VALID_KEYS,
    AlertConfig,
    AlertRuleConfig,
    CCConfig,
    MonitorConfig,
    ReplicaCheckConfig,
    TensorSpec,
)

__all__ = [
    "ALERT_RULES",
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
    "did_you_mean",
    "load_config",
    "parse_config",
    "parse_ops",
    "read_config_file",
]

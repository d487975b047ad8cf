"""Every config key, declared once: its name, type and default as a dataclass field, with a doc line.

The field names are msprobe's keys. parsing.py validates against these declarations: the keys that
take true/false and the integer keys (with their minimum) are read from the field types here, the
valid keys and the sub-keys of `cc_distribution`, `alert` and `replica_check` from the field names,
so a new key is one field here (plus its parser in parsing.py when it is not a bool or an int).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable

from ..system.short_repr import short_repr
from .errors import ConfigError

ALERT_RULES = ("AnomalyTurbulence", "AnomalyNan", "AnomalyRankOutlier")
ON_NAN = ("continue", "stop")  # alert.on_nan: what a non-finite statistic does to the job
TARGET_SLOTS = ("input", "output", "input_grad", "output_grad")
L2_HOOKS = ("attention_hook", "linear_hook", "moe_router_weight_hook", "moe_router_logit_hook")
TENSORBOARD_LAYOUTS = ("msprobe", "by_rank")  # msprobe: the rank in every tag; by_rank: one run per rank
SA_ORDERS = ("s,b,h,d", "b,s,h,d", "b,h,s,d")  # "b,h,s,d" (F.scaled_dot_product_attention's): msmon
MSPROBE_ONLY_KEYS: dict[str, str] = {}  # msprobe key -> what msmon does instead; accepted with a warning
# the categories of statistic rows (records/rows.py's TENSOR_CATEGORIES and "other": the config sits
# below the records; tests/unit/test_config_category_ops.py keeps the two lists equal)
STATISTIC_CATEGORIES = (
    "actv",
    "actv_grad",
    "grad_unreduced",
    "grad_reduced",
    "param_origin",
    "param_updated",
    "exp_avg",
    "exp_avg_sq",
    "update",
    "ratio",
    "other",
)


def key(
    default: Any = MISSING, *, doc: str, factory: Callable[[], Any] | None = None, minimum: int | None = None
) -> Any:
    """A config key's field: its default (or `factory` for a mutable one), its doc line, and for
    an integer key the smallest value it takes."""
    metadata: dict[str, Any] = {"doc": doc}
    if minimum is not None:
        metadata["minimum"] = minimum
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TensorSpec:
    """Which element of a module's input/output to monitor: "tensor", "tuple[N]", "tuple[N]:i"."""

    text: str
    length: int | None = None  # None: a bare tensor
    index: int = 0

    @classmethod
    def parse(cls, text: str, where: str) -> TensorSpec:
        if not isinstance(text, str):
            raise ConfigError(f'{where}: expected a string like "tensor" or "tuple[2]:0", got {short_repr(text)}')
        if text == "tensor":
            return cls(text)
        match = re.fullmatch(r"tuple\[(\d+)\](?::(\d+))?", text)
        if not match:
            raise ConfigError(f'{where}: expected "tensor", "tuple[N]" or "tuple[N]:i", got {short_repr(text)}')
        length, index = int(match.group(1)), int(match.group(2) or 0)
        if length < 1 or index >= length:
            raise ConfigError(f"{where}: index {index} is outside tuple[{length}] in {short_repr(text)}")
        return cls(text, length, index)


@dataclass
class CCConfig:
    enable: bool = key(False, doc="record the collectives (docs/comm.md)")
    cc_codeline: list[str] = key(
        doc="record only calls from these code lines (patterns like train.py[23])", factory=list
    )
    cc_pre_hook: bool = key(False, doc="record the collectives' inputs too, before the call")
    cc_log_only: bool = key(False, doc="log which collectives run, then stop with the recording ranks")


@dataclass
class AlertRuleConfig:
    rule_name: str
    threshold: float | None = None


@dataclass
class AlertConfig:
    rules: list[AlertRuleConfig] = key(
        doc="AnomalyTurbulence (with a threshold), AnomalyNan and AnomalyRankOutlier", factory=list
    )
    dump: bool = key(False, doc="append every alert to the anomaly dump (docs/anomaly.md)")
    max_lines_per_step: int = key(10, doc="msmon: alert lines logged per step and rank", minimum=0)
    on_nan: str = key(
        "continue",
        doc='msmon: "stop" ends the job, on every rank, after the step whose statistics hold a NaN or inf '
        '(output flushed, dump written, exit code 3); "continue" trains on (docs/anomaly.md)',
    )


@dataclass
class ReplicaCheckConfig:
    """Compare fingerprints of replicated weights (and reduced gradients) across data-parallel
    ranks every `every` steps (collectors/replica_check/)."""

    enable: bool = key(False, doc="compare the data-parallel ranks' replicated weights")
    every: int = key(100, doc="steps between two comparisons", minimum=1)
    grads: bool = key(False, doc="compare the reduced gradients too")


@dataclass
class TrackerConfig:
    """What the `wandb` and `mlflow` formats send (output/sinks/wandb_sink.py, mlflow_sink.py):
    lanes across ranks, logged by one rank, and explicit tensors only when named."""

    project: str | None = key(None, doc='the W&B project / MLflow experiment of a run msmon makes; None: "msmon"')
    run_name: str | None = key(None, doc="the name of a run msmon makes; None: the msmon run id")
    max_keys: int = key(1000, doc="keys sent at most per tracker run; the rest is not sent (said once)", minimum=1)
    tensors: list[str] = key(
        doc='explicit tensors, as "category/name" patterns (fnmatch): the logging rank\'s values', factory=list
    )


@dataclass
class MonitorConfig:
    """The validated config. Field names are the msprobe keys."""

    targets: dict[str, dict[str, TensorSpec]] = key(
        doc="modules or parameters to record, with the input/output element of each; {} the whole model", factory=dict
    )
    print_struct: bool = key(False, doc="write the module tree after the first step and stop cleanly")
    module_ranks: list[int] = key(doc="ranks that record; [] every rank", factory=list)
    ur_distribution: bool = key(False, doc="Adam's update and ratio, plus their TensorBoard histograms")
    heatmap_visualize: bool = key(False, doc="TensorBoard images of the update/ratio histograms over steps")
    xy_distribution: bool = key(False, doc="module inputs/outputs and their gradients of `targets`")
    all_xy: bool = key(False, doc="module inputs/outputs and their gradients of every module")
    xy_name_contains: list[str] = key(
        doc="msmon: the activations of every module whose name contains one of these strings (msprobe V2's "
        "monitors.module.targets); [] leaves it to targets",
        factory=list,
    )
    xy_each_call: bool = key(False, doc="msmon: one row per call of a module run several times per micro-step")
    forward_only: bool = key(False, doc="of the activations, only the forward ones (actv)")
    backward_only: bool = key(False, doc="of the activations, only their gradients (actv_grad)")
    mv_distribution: bool = key(False, doc="Adam's moments exp_avg and exp_avg_sq")
    param_distribution: bool = key(False, doc="weights before and after the optimizer step")
    wg_distribution: bool = key(False, doc="weight gradients, before and after the data-parallel reduction")
    monitor_mbs_grad: bool = key(False, doc="the rank-local weight gradient after every micro-batch")
    loss_distribution: bool = key(False, doc="msmon: the loss of every micro-step, unscaled (docs/loss.md)")
    grad_agreement: bool = key(
        False, doc="msmon: cos and norm ratio of the rank-local and the reduced gradient (docs/loss.md)"
    )
    cc_distribution: CCConfig = key(doc="collectives (docs/comm.md)", factory=CCConfig)
    alert: AlertConfig = key(doc="alert rules and the anomaly dump (docs/anomaly.md)", factory=AlertConfig)
    format: list[str] = key(
        doc="where rows go: any format with a sink file in msmon/output/sinks/", factory=lambda: ["tensorboard"]
    )
    tensorboard_layout: str = key(
        "msprobe",
        doc="msprobe: tags `{name}/rank{r}/{category}_{op}`; by_rank: no rank in the tag (ranks overlay as "
        "runs) plus per-category summary lanes (docs/tensorboard.md)",
    )
    ops: list[str] = key(
        doc="the statistics of each tensor (msmon.stats.ops)", factory=lambda: ["norm", "min", "max", "mean"]
    )
    category_ops: dict[str, list[str]] = key(
        doc="msmon: the ops a category's rows keep in the output, each a subset of `ops` (msprobe V2's per-monitor "
        "ops); a category not named keeps every op",
        factory=dict,
    )
    eps: float = key(1e-8, doc="the threshold of `zeros` (|x| < eps)")
    ndigits: int = key(6, doc="CSV digits: decimals from 1 up, significant digits below 1", minimum=0)
    step_count_per_record: int = key(1, doc="steps per CSV file", minimum=1)
    parquet_roll_steps: int = key(
        100,
        doc="msmon: steps per Parquet file (format parquet); a rank killed mid-run loses at most these "
        "(docs/results.md)",
        minimum=1,
    )
    parquet_roll_mb: int = key(
        128, doc="msmon: a Parquet file closes past this size in MiB, even mid-window", minimum=1
    )
    start_step: int = key(0, doc="the first step recorded", minimum=0)
    step_interval: int = key(1, doc="record every step_interval-th step", minimum=1)
    collect_times: int = key(100_000_000, doc="steps recorded, after which the hooks are removed", minimum=0)
    squash_name: bool = key(False, doc="shorten long framework prefixes of module names")
    dynamic_on: bool = key(False, doc="msprobe's dynamic mode: with DYNAMIC_MONITOR set, record once it is true")
    grad_acc_steps: int | None = key(None, doc="msmon: micro-batches per optimizer step; None counts them")
    nan_origin: bool | None = key(None, doc="report the first non-finite module; None: on with any alert rule")
    mg_direction: bool = key(False, doc="share of elements where sign(grad) == sign(exp_avg), per parameter")
    stack_info: bool = key(False, doc="stack_info.csv: each module's first forward call stack")
    append_output: list[str | None] = key(doc="[start, end] time prefixes of directories to resume into", factory=list)
    recording_l2_features: bool = key(False, doc="L2 features of the l2_targets modules (docs/l2_features.md)")
    l2_targets: dict[str, list[str]] = key(doc=f"{{hook: [module names]}}, hooks {list(L2_HOOKS)}", factory=dict)
    sa_order: str = key("s,b,h,d", doc=f"layout of the attention hook's q and k: one of {list(SA_ORDERS)}")
    replica_check: ReplicaCheckConfig = key(
        doc="compare replicated weights across data-parallel ranks", factory=ReplicaCheckConfig
    )
    tracker: TrackerConfig = key(
        doc="the wandb and mlflow formats: project, run name, key budget, explicit tensors (docs/trackers.md)",
        factory=TrackerConfig,
    )
    # Not config keys: the raw mapping, kept for printing and for the bootstrap; and, for an msprobe
    # V2 config (config/v2.py), its translation, one line per key.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    translation: list[str] = field(default_factory=list, repr=False, compare=False)

    @property
    def nan_origin_enabled(self) -> bool:
        if self.nan_origin is not None:
            return self.nan_origin
        return bool(self.alert.rules)

    @property
    def xy_enabled(self) -> bool:
        return self.xy_distribution or self.all_xy


def keys_of(config_class: type) -> tuple[str, ...]:
    """The keys of a config object (MonitorConfig, or one of its nested objects), in declaration order."""
    return tuple(f.name for f in dataclasses.fields(config_class) if "doc" in f.metadata)


# `from __future__ import annotations`: a field's type is the text of its annotation
_FIELDS = {f.name: f for f in dataclasses.fields(MonitorConfig) if "doc" in f.metadata}
VALID_KEYS = tuple(_FIELDS)
BOOL_KEYS = tuple(name for name, f in _FIELDS.items() if f.type in ("bool", bool))  # true or false
INT_KEYS = {name: f.metadata["minimum"] for name, f in _FIELDS.items() if f.type in ("int", int)}  # -> smallest value
DOCS = {name: f.metadata["doc"] for name, f in _FIELDS.items()}

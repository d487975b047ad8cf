"""What a recorded statistic is called, torch-free: the categories and their training stage,
a row's key, and the host-side record of one step that the writer hands to sinks.

A row is one tensor's statistics; its key says which tensor (category, name, pipeline chunk,
micro-step). Rows are appended in execution order, so a row's index within its step is its
call_id: the order the analyser uses to tell which anomaly came first within a rank. The
offline readers import this module too, so it never imports torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .layout import format_tag

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
CATEGORY_STAGE = {
    "actv": FORWARD,
    "actv_grad": BACKWARD,
    "grad_unreduced": BACKWARD,
    "grad_reduced": OPTIMIZER,
    "param_origin": OPTIMIZER,
    "param_updated": OPTIMIZER,
    "exp_avg": OPTIMIZER,
    "exp_avg_sq": OPTIMIZER,
    "update": OPTIMIZER,
    "ratio": OPTIMIZER,
    "other": FORWARD,
    "attention_hook": FORWARD,
    "linear_hook": FORWARD,
    "moe_router_weight_hook": FORWARD,
    "moe_router_logit_hook": FORWARD,
    "loss": BACKWARD,  # the scalar a backward pass starts from (loss_distribution)
    "grad_agreement": OPTIMIZER,  # the rank-local gradient against the reduced one (grad_agreement)
}
MICRO_STEP_CATEGORIES = ("actv", "actv_grad")
LOSS = "loss"  # the actv_grad row of the gradient that reaches the model's output from the loss
# L2 features (recording_l2_features), msprobe's names: category (CSV file prefix) ->
# (the word in the TensorBoard tag, the columns). Their rows hold one value each (RowKey.op)
# and are regrouped into one row per tensor with these columns on the writer thread.
FEATURE_CATEGORIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "attention_hook": ("qkt", ("entropy", "softmax_max")),
    "linear_hook": ("sr", ("sr", "kernel_norm")),
    "moe_router_weight_hook": ("router_weight", ("router_weight_similarity",)),
    "moe_router_logit_hook": ("router_logit", ("per_token_expert_entropy",)),
}
# every category whose rows have their own columns, not the statistics: the L2 features, the
# loss (one value per micro-step) and the gradient agreement (cos and norm ratio per step).
# Their rows travel as one-value rows (RowKey.op) and are regrouped on the writer thread
# (sinks/feature_rows.py); alert rules never read them.
COLUMN_CATEGORIES: dict[str, tuple[str, tuple[str, ...]]] = {
    **FEATURE_CATEGORIES,
    "loss": ("loss", ("value",)),
    "grad_agreement": ("grad_agreement", ("cos", "norm_ratio")),
}
# values derived from statistics, not statistics of one tensor: the gradient agreement's cos and
# norm ratio (quotients), the L2 features (entropies, ratios of norms). A quotient of zeros is
# undefined and recorded as NaN (a rank whose local gradient is exactly zero has no cos): such a
# NaN says nothing about whether a tensor was finite, so `alert.on_nan: "stop"` and the alert
# rules never count it as non-finite. The loss is a tensor's own value, not derived.
DERIVED_CATEGORIES = frozenset({*FEATURE_CATEGORIES, "grad_agreement"})
OTHER = "other"  # mg_direction's and the collectives' rows (`other_*.csv`)
COLLECTIVE_PHASES = ("pre", "post")  # a collective's row is `{op}@{site}/{phase}` (collectors/comm.py)
# the categories of one tensor's statistics, in training order (how the report lists them)
TENSOR_CATEGORIES = tuple(c for c in CATEGORY_STAGE if c != OTHER and c not in COLUMN_CATEGORIES)
# tensors that are the same on every data-parallel rank, so that a spread across ranks is news
REPLICATED_CATEGORIES = ("param_origin", "param_updated", "grad_reduced", "exp_avg", "exp_avg_sq", "update", "ratio")
# msprobe's names of the gradients in its anomaly.json, read by `msmon analyse`, and their stage
MSPROBE_GRAD_STAGE = {"pre_grad": BACKWARD, "acc_grad": BACKWARD, "post_grad": OPTIMIZER}
# a tensor of the category in words, as `msmon analyse` names it ("reduced gradient of fc1.weight");
# activations are named from the slot in their name instead (`forward output of fc1`)
CATEGORY_TEXT = {
    "grad_unreduced": "unreduced gradient of {}",
    "pre_grad": "unreduced gradient of {}",
    "acc_grad": "accumulated gradient of {}",
    "grad_reduced": "reduced gradient of {}",
    "post_grad": "reduced gradient of {}",
    "param_origin": "weight {} before the update",
    "param_updated": "weight {} after the update",
    "exp_avg": "first moment (exp_avg) of {}",
    "exp_avg_sq": "second moment (exp_avg_sq) of {}",
    "update": "update of {}",
    "ratio": "update/weight ratio of {}",
}


@dataclass(frozen=True)
class RowKey:
    """Identity of one recorded tensor within a step."""

    category: str
    name: str
    vpp_stage: int = 0
    micro_step: int | None = None
    stage: str | None = None  # overrides CATEGORY_STAGE (collectives run in either pass)
    op: str | None = None  # a COLUMN_CATEGORIES row: the one column its value belongs to

    @property
    def train_stage(self) -> str:
        return self.stage or CATEGORY_STAGE.get(self.category, OPTIMIZER)

    def display_name(self) -> str:
        """`{vpp}:{name}[:{micro_step}]`, the msprobe tag prefix."""
        base = f"{self.vpp_stage}:{self.name}"
        return base if self.micro_step is None else f"{base}:{self.micro_step}"

    def tag(self, rank: int | None) -> str:
        """The metric tag without the op: `{vpp}:{name}[:{micro}]/rank{r}/{category}` (for an L2
        feature, msprobe's word instead of the category: `.../rank0/qkt`); rank None: without
        the `rank{r}` part (the by_rank layout)."""
        feature = COLUMN_CATEGORIES.get(self.category)
        return format_tag(self.display_name(), rank, feature[0] if feature else self.category)


@functools.lru_cache(maxsize=1 << 16)
def row_key(category: str, name: str, vpp_stage: int = 0, micro_step: int | None = None) -> RowKey:
    """The RowKey of these fields, made once: collectors ask for the same keys every step, and
    a new object per row per step would only feed the garbage collector (RowKey is frozen, so
    one object can stand for every step)."""
    return RowKey(category, name, vpp_stage, micro_step)


class DirectionKey(RowKey):
    """An mg_direction row, where msprobe puts it: CSV category "other" (`other_*.csv`, beside
    the collectives), tag `{vpp}:{name}/rank{r}/mg_direction` (sinks append `_{op}`)."""

    CATEGORY = OTHER
    TASK = "mg_direction"

    def tag(self, rank: int | None) -> str:
        return format_tag(self.display_name(), rank, self.TASK)


class StepRecord:
    """One step's statistics, on the host, as the writer thread hands them to sinks.

    `table` is the float64 [rows, ops] torch tensor the values came from (typed Any: this module
    never imports torch, not even for a type); `values`, the same as Python lists, is made from
    it only when a reader asks (the API sink, a fallback): a list per row per step that nobody
    reads would only feed the garbage collector, whose collections stop the training thread too."""

    __slots__ = ("step", "rank", "ops", "keys", "_values", "histograms", "meta", "table")

    def __init__(
        self,
        step: int,
        rank: int,
        ops: list[str],
        keys: list[RowKey],
        values: list[list[float]] | None = None,
        histograms: list[tuple[str, list[float], list[float]]] | None = None,
        meta: dict[str, Any] | None = None,
        table: Any = None,
    ) -> None:
        if values is None and table is None:
            raise ValueError("a StepRecord needs its values or their table")
        self.step = step
        self.rank = rank
        self.ops = ops
        self.keys = keys
        self._values = values
        self.histograms = [] if histograms is None else histograms
        self.meta = {} if meta is None else meta
        self.table = table

    @property
    def values(self) -> list[list[float]]:
        if self._values is None:
            assert self.table is not None
            self._values = self.table.tolist()
        return self._values

    def __repr__(self) -> str:
        return f"StepRecord(step={self.step}, rank={self.rank}, ops={self.ops}, rows={len(self.keys)})"

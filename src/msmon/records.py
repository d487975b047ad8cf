"""What a recorded statistic is called, and the per-step buffer that keeps rows on the device.

A row is one tensor's statistics; its key says which tensor (category, name, pipeline chunk,
micro-step). Rows are appended in execution order, so a row's index within its step is its
call_id: the order the analyser uses to tell which anomaly came first within a rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .output_names import format_tag
from .row_finiteness import RowFiniteness

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
}
MICRO_STEP_CATEGORIES = ("actv", "actv_grad")
# L2 features (recording_l2_features), msprobe's names: category (CSV file prefix) ->
# (the word in the TensorBoard tag, the columns). Their rows hold one value each (RowKey.op)
# and are regrouped into one row per tensor with these columns on the writer thread.
FEATURE_CATEGORIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "attention_hook": ("qkt", ("entropy", "softmax_max")),
    "linear_hook": ("sr", ("sr", "kernel_norm")),
    "moe_router_weight_hook": ("router_weight", ("router_weight_similarity",)),
    "moe_router_logit_hook": ("router_logit", ("per_token_expert_entropy",)),
}


@dataclass(frozen=True)
class RowKey:
    """Identity of one recorded tensor within a step."""

    category: str
    name: str
    vpp_stage: int = 0
    micro_step: int | None = None
    stage: str | None = None  # overrides CATEGORY_STAGE (collectives run in either pass)
    op: str | None = None  # a FEATURE_CATEGORIES row: the one column its value belongs to

    @property
    def train_stage(self) -> str:
        return self.stage or CATEGORY_STAGE.get(self.category, OPTIMIZER)

    def display_name(self) -> str:
        """`{vpp}:{name}[:{micro_step}]`, the msprobe tag prefix."""
        base = f"{self.vpp_stage}:{self.name}"
        return base if self.micro_step is None else f"{base}:{self.micro_step}"

    def tag(self, rank: int) -> str:
        """The metric tag without the op: `{vpp}:{name}[:{micro}]/rank{r}/{category}` (for an L2
        feature, msprobe's word instead of the category: `.../rank0/qkt`)."""
        feature = FEATURE_CATEGORIES.get(self.category)
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

    CATEGORY = "other"
    TASK = "mg_direction"

    def tag(self, rank: int) -> str:
        return format_tag(self.display_name(), rank, self.TASK)


@dataclass
class Histogram:
    """A histogram computed on the device: counts over fixed bucket edges."""

    tag: str
    edges: list[float]
    counts: torch.Tensor


class StepRecord:
    """One step's statistics, on the host, as the writer thread hands them to sinks.

    `table` is the float64 [rows, ops] tensor the values came from; `values`, the same as
    Python lists, is made from it only when a reader asks (the API sink, a fallback): a list per
    row per step that nobody reads would only feed the garbage collector, whose collections
    stop the training thread too."""

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
        table: torch.Tensor | None = None,
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


class RowGroup:
    """The rows of one key that a module called several times in a micro-step produces (a cell
    run in a Python loop): one row per call while the step runs, combined into the row of all
    calls together (msmon.stats.combine_rows: norms in squares, min of mins, ...) when the
    step's rows are taken. A group of one row is that row. One object per key and step: the
    first row is held in place, lists only for a module that is called again."""

    __slots__ = ("ops", "first", "first_numel", "more")

    def __init__(self, ops: list[str]) -> None:
        self.ops = ops
        self.first: torch.Tensor | None = None
        self.first_numel = 0
        self.more: list[tuple[torch.Tensor, int]] | None = None

    def add(self, row: torch.Tensor, numel: int) -> None:
        if self.first is None:
            self.first, self.first_numel = row, numel
        elif self.more is None:
            self.more = [(row, numel)]
        else:
            self.more.append((row, numel))

    def combined(self) -> torch.Tensor:
        assert self.first is not None, "an empty RowGroup has no row"
        if self.more is None:
            return self.first
        from .stats import combine_rows  # records is imported by stats' users; keep it light

        rows = [self.first] + [row for row, _ in self.more]
        numels = [self.first_numel] + [numel for _, numel in self.more]
        stacked = torch.stack([r.to(rows[0].device) for r in rows])
        return combine_rows(stacked, torch.tensor(numels, dtype=stacked.dtype), self.ops)


class StepBuffer:
    """Collects rows on the device during a step; one concatenation and copy at its end."""

    def __init__(self) -> None:
        self.keys: list[RowKey] = []
        self._chunks: list[torch.Tensor | list[torch.Tensor | RowGroup]] = []
        self._single: list[torch.Tensor | RowGroup] = []  # rows added one by one since the last chunk
        self.histograms: list[Histogram] = []
        self.flag_keys: list[RowKey] = []
        self.flags: list[torch.Tensor | tuple[torch.Tensor, RowFiniteness]] = []

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: RowKey, row: torch.Tensor | RowGroup) -> None:
        """One [ops] row, or a RowGroup that will be one row when the step's rows are taken.
        Rows added one by one are stacked together later: one kernel for a run of them instead
        of one reshaping call each (a hook adds one per activation)."""
        self.keys.append(key)
        self._single.append(row)

    def _close_run(self) -> None:
        if self._single:  # stacked in take(): a RowGroup in the run may still grow
            self._chunks.append(self._single)
            self._single = []

    def add_many(self, keys: list[RowKey], rows: torch.Tensor) -> None:
        if keys:
            self._close_run()
            self.keys.extend(keys)
            self._chunks.append(rows)

    def add_flag(self, key: RowKey, finite: torch.Tensor) -> None:
        """A 0-d bool: is this tensor free of NaN/Inf (for the non-finite origin)."""
        self.flag_keys.append(key)
        self.flags.append(finite)

    def add_flag_of_row(self, key: RowKey, row: torch.Tensor, test: RowFiniteness) -> None:
        """The flag of a tensor whose statistics row was taken already: told by the row when the
        step's flags are taken, all such rows in one batch (msmon.row_finiteness)."""
        self.flag_keys.append(key)
        self.flags.append((row, test))

    def take(
        self,
    ) -> tuple[list[RowKey], list[torch.Tensor], list[Histogram], list[RowKey], torch.Tensor | None]:
        """Hand over everything recorded so far and start empty; the flags as one [n] bool tensor."""
        self._close_run()
        chunks: list[torch.Tensor] = []
        for chunk in self._chunks:
            if isinstance(chunk, torch.Tensor):
                chunks.append(chunk)
            else:
                chunks.extend(_stacked(chunk))
        taken = self.keys, chunks, self.histograms, self.flag_keys, _resolved_flags(self.flags)
        self.keys, self._chunks, self.histograms, self.flag_keys, self.flags = [], [], [], [], []
        return taken

    def clear(self) -> None:
        """Forget everything recorded so far (nothing is computed)."""
        self.keys, self._single, self._chunks, self.histograms, self.flag_keys, self.flags = [], [], [], [], [], []


def _resolved_flags(entries: list[torch.Tensor | tuple[torch.Tensor, RowFiniteness]]) -> torch.Tensor | None:
    """The step's flags in order as one [n] bool tensor: a kernel per run of flags of one kind
    (0-d flags stacked; rows stacked and tested together), not one per flag."""
    if not entries:
        return None
    parts: list[torch.Tensor] = []
    start = 0
    while start < len(entries):
        of_rows = isinstance(entries[start], tuple)
        end = start + 1
        while end < len(entries) and isinstance(entries[end], tuple) == of_rows:
            end += 1
        run = entries[start:end]
        if of_rows:
            pairs = [entry for entry in run if isinstance(entry, tuple)]
            test = pairs[0][1]  # one step, one set of ops
            parts.append(test.flags(_stack_on_one_device([row for row, _ in pairs])))
        else:
            flags = [entry for entry in run if isinstance(entry, torch.Tensor)]
            parts.append(_stack_on_one_device(flags).to(torch.bool))
        start = end
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p.to(parts[0].device) for p in parts])


def _stack_on_one_device(tensors: list[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(tensors)
    except RuntimeError:  # on several devices
        return torch.stack([t.to(tensors[0].device) for t in tensors])


def _stacked(run: list[torch.Tensor | RowGroup]) -> list[torch.Tensor]:
    """A run of single rows as one [n, ops] chunk (one per row if they are on several devices:
    stage_to_host groups chunks by device)."""
    rows = [r.combined() if isinstance(r, RowGroup) else r for r in run]
    try:
        return [torch.stack(rows)]
    except RuntimeError:
        return [r.unsqueeze(0) for r in rows]

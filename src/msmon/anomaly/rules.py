"""Alert rules, applied on the writer thread to each step's host values.

Nothing here runs on the training thread: the rows arrive after the step's one device-to-host
copy, so a rule can look at every value without a sync.

AnomalyNan(threshold=None)
    A row alerts when any statistic is NaN or +-inf, its `nans`/`infs` count is positive, or,
    with a threshold, |norm|, |min| or |max| exceeds it. A norm or mean that overflowed to inf
    while min and max (or the counts) prove the tensor finite is not a non-finite tensor (a
    GradScaler's scaled gradient): only the threshold can alert on it. Rows of derived values
    (the gradient agreement's cos, the L2 features) never reach the rules: an undefined 0/0 is
    NaN there (records.DERIVED_CATEGORIES).

AnomalyTurbulence(threshold)
    Watches two magnitudes of every recorded tensor: its `norm` and its peak |x|, that is
    max(|min|, |max|) (whichever of min/max is recorded). With m the magnitude now and h its
    history, it alerts when

        m > h * (1 + threshold)      (a jump up)   or   m < h / (1 + threshold)   (a collapse)

    so threshold 2 means "more than 3x, or less than a third, of the usual value". The test is
    symmetric in ratio, so a collapse is caught whatever the threshold (a linear band could
    never see a fall below zero for threshold >= 1).

    History: per (category, name, vpp stage, magnitude), a bias-corrected exponential moving
    average over steps, s <- (1 - a) * s + a * x, h = s / (1 - (1 - a)^n), a = EMA_ALPHA, n
    the number of steps seen, where x is the mean over the step's micro-steps. No alert fires
    before n >= warmup (WARMUP steps by default), nor when h is 0 (no scale to compare to).
    After the warm-up a value outside the band enters the history clipped to the band's edge:
    a single spike neither hides the next one nor makes the return to normal look like a
    collapse, while a lasting level change is absorbed within a few steps. Non-finite values
    never enter the history (they are AnomalyNan's business).

    Scope: `mean` is never watched (near zero for gradients and LayerNorm outputs: pure noise),
    nor are the counts; min and max count only as the peak magnitude, because a min or max
    near zero (ReLU outputs, token ids, a gradient whose signs are mostly alike) jumps by large
    ratios for no reason. Adam's moments (exp_avg, exp_avg_sq) are not watched: they are moving
    averages of the gradient, which is watched, and they grow by construction in the first
    thousand steps (1 - beta^t), which a relative rule reads as turbulence.

AnomalyRankOutlier compares the data-parallel ranks with each other, not a row with its
history: anomaly/rank_spread.py holds its test, collectors/rank_outlier/ its exchange.

A row gives at most one alert: its first symptom (AnomalyNan before AnomalyTurbulence), the
other symptoms folded into the message, so one bad tensor is one line and one dump record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..config import AlertRuleConfig
from ..records.rows import RowKey
from ..stats.finiteness import row_is_finite
from ..stats.ops import COUNT_OPS, MAGNITUDE_OPS
from .event import RANK_OUTLIER_RULE

EMA_ALPHA = 0.3
WARMUP = 5
UNWATCHED_CATEGORIES = frozenset({"exp_avg", "exp_avg_sq"})


@dataclass
class Alert:
    """One tensor's anomaly in one step; `call_id` is its row's position in the step."""

    key: RowKey
    call_id: int
    op: str
    value: float
    history: float | None
    rule: str
    message: str


@dataclass
class _Symptom:
    rule: str
    op: str
    value: float
    history: float | None
    text: str


class AnomalyNan:
    """Non-finite statistics or counts, or a magnitude above an absolute threshold."""

    name = "AnomalyNan"

    def __init__(self, threshold: float | None = None) -> None:
        self.threshold = threshold

    def check_row(self, ops: Sequence[str], row: Sequence[float]) -> _Symptom | None:
        """The row's most telling non-finite symptom, or the first value over the threshold. A
        norm or mean that overflowed to inf on a tensor its min and max (or NaN and inf counts)
        prove finite is no non-finite symptom (stats/finiteness.py); its magnitude may still be
        over the threshold."""
        first_bad: _Symptom | None = None
        for op, value in zip(ops, row):
            if op in COUNT_OPS:
                if value > 0:  # a count says how many: better than "norm is nan"
                    kind = "NaN" if op == "nans" else "inf"
                    return _Symptom(self.name, op, value, None, f"{int(value)} {kind} value{'s' if value != 1 else ''}")
            elif not math.isfinite(value) and first_bad is None:
                first_bad = _Symptom(self.name, op, value, None, f"{op}={_fmt(value)}")
        if first_bad is not None and row_is_finite(ops, row) is not True:
            return first_bad
        if self.threshold is not None:
            for op, value in zip(ops, row):
                if op in MAGNITUDE_OPS and abs(value) > self.threshold:
                    return _Symptom(
                        self.name, op, value, None, f"|{op}|={_fmt(abs(value))} > threshold {self.threshold:g}"
                    )
        return None


class AnomalyTurbulence:
    """A magnitude more than (1 + threshold) times above or below its history."""

    name = "AnomalyTurbulence"

    def __init__(self, threshold: float) -> None:
        if not threshold > 0:
            raise ValueError(f"AnomalyTurbulence needs a positive threshold, got {threshold!r}")
        self.threshold = threshold

    @property
    def factor(self) -> float:
        return 1.0 + self.threshold

    def check(self, op: str, value: float, history: float | None) -> _Symptom | None:
        if history is None or history <= 0 or not math.isfinite(value):
            return None
        ratio = abs(value) / history
        if ratio > self.factor or ratio < 1.0 / self.factor:
            return _Symptom(
                self.name,
                op,
                value,
                history,
                f"|{op}|={_fmt(abs(value))} is {ratio:.3g}x its history {_fmt(history)} (threshold {self.threshold:g})",
            )
        return None


def build_rules(configs: Iterable[AlertRuleConfig]) -> list[AnomalyNan | AnomalyTurbulence]:
    """The rule objects for a validated `alert.rules` list."""
    rules: list[AnomalyNan | AnomalyTurbulence] = []
    for cfg in configs:
        if cfg.rule_name == RANK_OUTLIER_RULE:  # compares ranks, not a rank's rows: collectors/rank_outlier/
            continue
        if cfg.rule_name == "AnomalyNan":
            rules.append(AnomalyNan(cfg.threshold))
        else:
            if cfg.threshold is None:
                raise ValueError("AnomalyTurbulence needs a threshold")
            rules.append(AnomalyTurbulence(cfg.threshold))
    return rules


def _fmt(value: float) -> str:
    return f"{value:.6g}"


class _Layout:
    """Where each watched statistic sits in a row, for one ops list (computed once)."""

    def __init__(self, ops: Sequence[str]) -> None:
        index = {op: i for i, op in enumerate(ops)}
        self.norm = index.get("norm")
        self.extremes = [(op, index[op]) for op in ("max", "min") if op in index]
        self.counts = [index[op] for op in COUNT_OPS if op in index]
        self.magnitudes = [index[op] for op in MAGNITUDE_OPS if op in index]

    def suspicious_rows(self, table: torch.Tensor, bound: float | None) -> list[int]:
        """A cheap screen before AnomalyNan looks closely, for the whole step at once: rows with
        anything non-finite, any count, or a magnitude over the smallest threshold."""
        bad = ~torch.isfinite(table).all(1)
        if self.counts:
            bad |= (table[:, self.counts] > 0).any(1)
        if bound is not None and self.magnitudes:
            bad |= (table[:, self.magnitudes].abs() > bound).any(1)
        return bad.nonzero().view(-1).tolist()

    def watched(self, table: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(magnitude, [n] values, which extreme each peak is) for the norm and the peak
        max(|min|, |max|) (the first of equals, max before min). A peak whose min or max is not
        finite is NaN: it is neither checked nor remembered (AnomalyNan's business)."""
        out: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        if self.norm is not None:
            out.append((NORM, table[:, self.norm], None))
        if self.extremes:
            columns = table[:, [i for _, i in self.extremes]]
            pick: torch.Tensor | None = None
            if len(self.extremes) == 1:
                peak = columns[:, 0]
            else:
                magnitude = columns.abs()
                pick = (magnitude[:, 1] > magnitude[:, 0]).long()
                peak = columns.gather(1, pick.unsqueeze(1)).squeeze(1)
            peak = torch.where(torch.isfinite(columns).all(1), peak, math.nan)
            out.append((PEAK, peak, pick))
        return out

    def peak_op(self, pick: torch.Tensor | None, row: int) -> str:
        return self.extremes[0 if pick is None else int(pick[row])][0]


NORM, PEAK = 0, 1  # the two watched magnitudes of a tensor: its history slots are 2 * tensor + magnitude
_MAGNITUDE_NAMES = ("norm", "peak")


class RuleEngine:
    """Keeps the per-statistic history and yields the alerts of one step.

    It runs on the writer thread, whose CPU time a machine with few cores takes from the
    training, so a step is checked as one table: the screens, the turbulence test and the
    history update are a few tensor operations over all rows, and only the rows that alert are
    looked at one by one. The history of each (category, name, vpp stage, magnitude) lives in
    a slot of two float64 tensors (the EMA's sum and its step count)."""

    def __init__(
        self, rules: list[AnomalyNan | AnomalyTurbulence], warmup: int = WARMUP, alpha: float = EMA_ALPHA
    ) -> None:
        self.rules = rules
        self.warmup = max(int(warmup), 1)
        self.alpha = alpha
        self._nan_rules = [r for r in rules if isinstance(r, AnomalyNan)]
        bounds = [r.threshold for r in self._nan_rules if r.threshold is not None]
        self._nan_bound = min(bounds) if bounds else None
        self._turbulence = sorted((r for r in rules if isinstance(r, AnomalyTurbulence)), key=lambda r: r.threshold)
        # the band a value is clipped to before it enters the history: the loosest rule's
        self._clip = self._turbulence[-1].factor if self._turbulence else None
        self._slots: dict[tuple[str, str, int], int] = {}  # (category, name, vpp) -> tensor index
        self._sums = torch.zeros(0, dtype=torch.float64)  # [2 * tensors]: the EMA's s per slot
        self._counts = torch.zeros(0, dtype=torch.float64)  # [2 * tensors]: steps n per slot
        self._bias: list[float] = []  # 1 - (1 - a)^n by n, up to where it is 1.0
        self._bias_table = torch.ones(1, dtype=torch.float64)
        self._layouts: dict[tuple[str, ...], _Layout] = {}

    def history(self, category: str, name: str, vpp_stage: int, magnitude: str) -> float | None:
        """The history h of one watched magnitude ("norm" or "peak"), None while warming up."""
        tensor = self._slots.get((category, name, vpp_stage))
        if tensor is None:
            return None
        slot = 2 * tensor + _MAGNITUDE_NAMES.index(magnitude)
        n = int(self._counts[slot])
        if n < self.warmup:
            return None
        return float(self._sums[slot]) / (1.0 - (1.0 - self.alpha) ** n)

    def scan(
        self,
        keys: list[RowKey],
        ops: list[str],
        values: list[list[float]] | None,
        table: torch.Tensor | None = None,
    ) -> list[Alert]:
        """Check one step's rows (in recording order) and update the history. `table`: the
        values as a float64 [rows, ops] CPU tensor, when the caller has it (then `values` may be
        None: the few rows that look suspicious are read from the table)."""
        if not self.rules or not keys:
            return []
        layout = self._layouts.get(tuple(ops))
        if layout is None:
            layout = self._layouts[tuple(ops)] = _Layout(ops)
        if table is None or table.dtype != torch.float64 or tuple(table.shape) != (len(keys), len(ops)):
            if values is None:
                raise ValueError("RuleEngine.scan needs the values or their float64 [rows, ops] table")
            table = torch.tensor(values, dtype=torch.float64).reshape(len(keys), len(ops))
        symptoms: dict[int, list[_Symptom]] = {}
        if self._nan_rules:
            for i in layout.suspicious_rows(table, self._nan_bound):
                for nan_rule in self._nan_rules:
                    found = nan_rule.check_row(ops, values[i] if values is not None else table[i].tolist())
                    if found is not None:
                        symptoms[i] = [found]
                        break
        if self._turbulence:
            self._turbulence_scan(keys, table, layout, symptoms)
        alerts = []
        for call_id in sorted(symptoms):
            row_symptoms = symptoms[call_id]
            first = row_symptoms[0]
            message = "; ".join(s.text for s in row_symptoms)
            alerts.append(Alert(keys[call_id], call_id, first.op, first.value, first.history, first.rule, message))
        return alerts

    def _tensor_slots(self, keys: list[RowKey]) -> torch.Tensor:
        """[rows] history index of each row's tensor, -1 where its category is not watched."""
        slots = self._slots
        out = []
        for key in keys:
            category = key.category
            if category in UNWATCHED_CATEGORIES:
                out.append(-1)
                continue
            ident = (category, key.name, key.vpp_stage)
            slot = slots.get(ident)
            if slot is None:
                slot = slots[ident] = len(slots)
            out.append(slot)
        size = 2 * len(slots)
        if size > len(self._sums):
            grown = max(size, 2 * len(self._sums))
            self._sums = torch.cat([self._sums, torch.zeros(grown - len(self._sums), dtype=torch.float64)])
            self._counts = torch.cat([self._counts, torch.zeros(grown - len(self._counts), dtype=torch.float64)])
        return torch.tensor(out, dtype=torch.long)

    def _bias_of(self, counts: torch.Tensor) -> torch.Tensor:
        """1 - (1 - a)^n for each n, as Python computes it (a table, exact, not a tensor pow);
        the table stops growing where the value reaches 1.0, which it stays."""
        bias = self._bias
        most = int(counts.max()) if len(counts) else 0  # a CPU tensor: nothing to wait for
        if len(bias) <= most and not (bias and bias[-1] == 1.0):
            size = max(most + 1, 2 * len(bias), 16)  # doubled: not a new table every step
            while len(bias) < size and not (bias and bias[-1] == 1.0):
                bias.append(1.0 - (1.0 - self.alpha) ** len(bias))
            self._bias_table = torch.tensor(bias, dtype=torch.float64)
        return self._bias_table[counts.long().clamp(max=len(self._bias_table) - 1)]

    def _turbulence_scan(
        self, keys: list[RowKey], table: torch.Tensor, layout: _Layout, symptoms: dict[int, list[_Symptom]]
    ) -> None:
        tensors = self._tensor_slots(keys)
        watched = tensors >= 0
        rule = self._turbulence[0]  # the tightest band: any rule that fires, this one does first
        factor = rule.factor
        total = torch.zeros_like(self._sums)
        seen = torch.zeros_like(self._sums)
        for magnitude, value, pick in layout.watched(table):
            slots = torch.where(watched, 2 * tensors + magnitude, 0)
            counts = self._counts[slots]
            warm = watched & (counts >= self.warmup)
            history = torch.where(warm, self._sums[slots] / self._bias_of(counts), math.nan)
            size = value.abs()
            finite = torch.isfinite(value)
            scaled = history > 0
            ratio = size / history
            alert = warm & scaled & finite & ((ratio > factor) | (ratio < 1.0 / factor))
            for i in alert.nonzero().view(-1).tolist():
                op = "norm" if magnitude == NORM else layout.peak_op(pick, i)
                found = rule.check(op, float(value[i]), float(history[i]))
                if found is not None:
                    symptoms.setdefault(i, []).append(found)
            if self._clip is not None:
                band = warm & scaled
                size = torch.where(
                    band, torch.minimum(torch.maximum(size, history / self._clip), history * self._clip), size
                )
            entering = (watched & finite).nonzero().view(-1)
            total.index_add_(0, slots[entering], size[entering])
            seen.index_add_(0, slots[entering], torch.ones(len(entering), dtype=torch.float64))
        self._update(total, seen)

    def _update(self, total: torch.Tensor, seen: torch.Tensor) -> None:
        """s <- (1 - a) s + a x for every slot seen this step, x the mean of its values."""
        slots = (seen > 0).nonzero().view(-1)
        if not len(slots):
            return
        a = self.alpha
        self._sums[slots] = (1.0 - a) * self._sums[slots] + a * total[slots] / seen[slots]
        self._counts[slots] += 1

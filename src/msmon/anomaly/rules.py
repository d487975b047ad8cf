"""Alert rules, applied on the writer thread to each step's host values.

Nothing here runs on the training thread: the rows arrive after the step's one device-to-host
copy, so a rule can look at every value without a sync.

AnomalyNan(threshold=None)
    A row alerts when any statistic is NaN or +-inf, its `nans`/`infs` count is positive, or,
    with a threshold, |norm|, |min| or |max| exceeds it.

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

A row gives at most one alert: its first symptom (AnomalyNan before AnomalyTurbulence), the
other symptoms folded into the message, so one bad tensor is one line and one dump record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..config import AlertRuleConfig
from ..ops import COUNT_OPS, MAGNITUDE_OPS
from ..records import RowKey

EMA_ALPHA = 0.3
WARMUP = 5
UNWATCHED_CATEGORIES = frozenset({"exp_avg", "exp_avg_sq"})
NAN_ORIGIN_RULE = "NanOrigin"  # records written by the first-non-finite-origin detector
REPLICA_RULE = "ReplicaMismatch"  # records of the replica check (collectors/replica_check.py)
REPLICA_OP = "replica_mismatch"


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
        """The row's most telling non-finite symptom, or the first value over the threshold."""
        first_bad: _Symptom | None = None
        for op, value in zip(ops, row):
            if op in COUNT_OPS:
                if value > 0:  # a count says how many: better than "norm is nan"
                    kind = "NaN" if op == "nans" else "inf"
                    return _Symptom(self.name, op, value, None, f"{int(value)} {kind} value{'s' if value != 1 else ''}")
            elif not math.isfinite(value) and first_bad is None:
                first_bad = _Symptom(self.name, op, value, None, f"{op}={_fmt(value)}")
        if first_bad is not None:
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

    def watched(self, row: Sequence[float]) -> list[tuple[str, str, float]]:
        """(history name, reported op, value): the norm, and the peak of min/max."""
        out: list[tuple[str, str, float]] = []
        if self.norm is not None:
            out.append(("norm", "norm", row[self.norm]))
        if self.extremes:
            pairs = [(op, row[i]) for op, i in self.extremes]
            bad = [(op, v) for op, v in pairs if not math.isfinite(v)]
            op, value = bad[0] if bad else max(pairs, key=lambda item: abs(item[1]))
            out.append(("peak", op, value))
        return out

    def suspicious(self, row: Sequence[float], bound: float | None) -> bool:
        """A cheap screen before AnomalyNan looks closely: anything non-finite, any count,
        or a magnitude over the smallest threshold."""
        if not all(map(math.isfinite, row)) or any(row[i] > 0 for i in self.counts):
            return True
        return bound is not None and any(abs(row[i]) > bound for i in self.magnitudes)


class RuleEngine:
    """Keeps the per-statistic history and yields the alerts of one step."""

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
        self._sums: dict[tuple[str, str, int, str], tuple[float, int]] = {}
        self._layouts: dict[tuple[str, ...], _Layout] = {}

    def history(self, category: str, name: str, vpp_stage: int, magnitude: str) -> float | None:
        """The history h of one watched magnitude ("norm" or "peak"), None while warming up."""
        return self._history((category, name, vpp_stage, magnitude))

    def _history(self, hkey: tuple[str, str, int, str]) -> float | None:
        entry = self._sums.get(hkey)
        if entry is None or entry[1] < self.warmup:
            return None
        s, n = entry
        return s / (1.0 - (1.0 - self.alpha) ** n)

    def scan(self, keys: list[RowKey], ops: list[str], values: list[list[float]]) -> list[Alert]:
        """Check one step's rows (in recording order) and update the history."""
        if not self.rules:
            return []
        layout = self._layouts.get(tuple(ops))
        if layout is None:
            layout = self._layouts[tuple(ops)] = _Layout(ops)
        alerts: list[Alert] = []
        step_values: dict[tuple[str, str, int, str], list[float]] = {}
        for call_id, (key, row) in enumerate(zip(keys, values)):
            symptoms: list[_Symptom] = []
            if self._nan_rules and layout.suspicious(row, self._nan_bound):
                for nan_rule in self._nan_rules:
                    found = nan_rule.check_row(ops, row)
                    if found is not None:
                        symptoms.append(found)
                        break
            if self._turbulence and key.category not in UNWATCHED_CATEGORIES:
                for magnitude, op, value in layout.watched(row):
                    hkey = (key.category, key.name, key.vpp_stage, magnitude)
                    history = self._history(hkey)
                    if history is not None:
                        for rule in self._turbulence:
                            found = rule.check(op, value, history)
                            if found is not None:
                                symptoms.append(found)
                                break
                    if math.isfinite(value):
                        acc = step_values.get(hkey)
                        if acc is None:
                            acc = step_values[hkey] = [0.0, 0]
                        acc[0] += self._clipped(abs(value), history)
                        acc[1] += 1
            if symptoms:
                first = symptoms[0]
                message = "; ".join(s.text for s in symptoms)
                alerts.append(Alert(key, call_id, first.op, first.value, first.history, first.rule, message))
        self._update(step_values)
        return alerts

    def _clipped(self, magnitude: float, history: float | None) -> float:
        if history is None or history <= 0 or self._clip is None:
            return magnitude
        return min(max(magnitude, history / self._clip), history * self._clip)

    def _update(self, step_values: dict[tuple[str, str, int, str], list]) -> None:
        a = self.alpha
        for hkey, (total, count) in step_values.items():
            s, n = self._sums.get(hkey, (0.0, 0))
            self._sums[hkey] = ((1.0 - a) * s + a * total / count, n + 1)

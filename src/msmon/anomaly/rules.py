"""Alert rules, applied on the writer thread to each step's host values.

AnomalyTurbulence: for each (category, name, vpp stage, op) the history h is an exponential
moving average of |value| over earlier steps, h <- (1 - alpha) * h + alpha * |value| with
alpha = 0.1, seeded with the first value. After `warmup` observations, a finite value alerts
when | |value| - h | > threshold * h: a jump up or a collapse down by more than `threshold`
relative to its history. Micro-steps of one step share a history. It watches `norm`, `min`
and `max` (as magnitudes); `mean` is near zero for gradients and pure noise, counts are for
AnomalyNan. Non-finite values never enter the history.

AnomalyNan: a NaN or +-inf statistic, a positive `nans`/`infs` count, or, with a threshold,
|value| > threshold for norm/min/max.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from ..config import AlertRuleConfig
from ..records import RowKey

TURBULENCE_OPS = ("norm", "min", "max")
EMA_ALPHA = 0.1
WARMUP = 5


@dataclass
class Alert:
    key: RowKey
    call_id: int
    op: str
    value: float
    history: float | None
    rule: str
    message: str


class AnomalyNan:
    name = "AnomalyNan"

    def __init__(self, threshold: float | None = None) -> None:
        self.threshold = threshold

    def check(self, key: RowKey, op: str, value: float, history: float | None) -> str | None:
        if math.isnan(value) or math.isinf(value):
            return f"{op} is {value}"
        if op in ("nans", "infs") and value > 0:
            return f"{int(value)} {'NaN' if op == 'nans' else 'inf'} values"
        if self.threshold is not None and op in TURBULENCE_OPS and abs(value) > self.threshold:
            return f"|{op}| = {abs(value):.6g} > threshold {self.threshold:g}"
        return None


class AnomalyTurbulence:
    name = "AnomalyTurbulence"

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def check(self, key: RowKey, op: str, value: float, history: float | None) -> str | None:
        if history is None or op not in TURBULENCE_OPS or not math.isfinite(value):
            return None
        magnitude = abs(value)
        if abs(magnitude - history) > self.threshold * history:
            direction = "up" if magnitude > history else "down"
            return (f"|{op}| = {magnitude:.6g} moved {direction} from history {history:.6g} "
                    f"by more than {self.threshold:.0%}")
        return None


def build_rules(configs: Iterable[AlertRuleConfig]) -> list[AnomalyNan | AnomalyTurbulence]:
    rules: list[AnomalyNan | AnomalyTurbulence] = []
    for cfg in configs:
        if cfg.rule_name == "AnomalyNan":
            rules.append(AnomalyNan(cfg.threshold))
        else:
            assert cfg.threshold is not None
            rules.append(AnomalyTurbulence(cfg.threshold))
    return rules


class RuleEngine:
    """Keeps per-statistic history and yields the alerts of one step."""

    def __init__(self, rules: list[AnomalyNan | AnomalyTurbulence], warmup: int = WARMUP) -> None:
        self.rules = rules
        self.warmup = warmup
        self._history: dict[tuple[str, str, int, str], tuple[float, int]] = {}

    def scan(self, keys: list[RowKey], ops: list[str], values: list[list[float]]) -> list[Alert]:
        if not self.rules:
            return []
        alerts: list[Alert] = []
        updates: dict[tuple[str, str, int, str], list[float]] = {}
        for call_id, (key, row) in enumerate(zip(keys, values)):
            first: Alert | None = None
            others: list[str] = []
            for op, value in zip(ops, row):
                hkey = (key.category, key.name, key.vpp_stage, op)
                ema, seen = self._history.get(hkey, (0.0, 0))
                history = ema if seen >= self.warmup else None
                for rule in self.rules:
                    message = rule.check(key, op, value, history)
                    if message is not None:
                        if first is None:
                            first = Alert(key, call_id, op, value, ema if seen else None, rule.name, message)
                        else:
                            others.append(message)
                        break
                if op in TURBULENCE_OPS and math.isfinite(value):
                    updates.setdefault(hkey, []).append(abs(value))
            if first is not None:  # one alert per tensor: its first symptom, the rest in the message
                if others:
                    first.message += "; also " + "; ".join(others)
                alerts.append(first)
        for hkey, magnitudes in updates.items():
            ema, seen = self._history.get(hkey, (0.0, 0))
            step_value = sum(magnitudes) / len(magnitudes)
            ema = step_value if seen == 0 else (1 - EMA_ALPHA) * ema + EMA_ALPHA * step_value
            self._history[hkey] = (ema, seen + 1)
        return alerts

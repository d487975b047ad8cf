"""The rule engine checks a step as one table; the alerts and the history must be exactly those of
the rules applied row by row (the module docstring of msmon.anomaly.rules), here restated in plain
Python and run on random steps with NaN, inf, counts, repeated micro-steps and unwatched rows."""

from __future__ import annotations

import math
import random

import torch

from msmon.anomaly.rules import EMA_ALPHA, WARMUP, AnomalyNan, AnomalyTurbulence, RuleEngine
from msmon.records.rows import RowKey

OPS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]


class RowByRow:
    """The documented semantics, one row at a time, floats only."""

    def __init__(self, rules, warmup=WARMUP, alpha=EMA_ALPHA):
        self.nan_rules = [r for r in rules if isinstance(r, AnomalyNan)]
        self.turbulence = sorted((r for r in rules if isinstance(r, AnomalyTurbulence)), key=lambda r: r.threshold)
        self.warmup, self.alpha = warmup, alpha
        self.sums: dict[tuple, tuple[float, int]] = {}

    def history(self, hkey):
        s, n = self.sums.get(hkey, (0.0, 0))
        return None if n < self.warmup else s / (1.0 - (1.0 - self.alpha) ** n)

    def scan(self, keys, ops, values):
        index = {op: i for i, op in enumerate(ops)}
        alerts, step = [], {}
        for call_id, (key, row) in enumerate(zip(keys, values)):
            found = []
            for rule in self.nan_rules:
                symptom = rule.check_row(ops, row)
                if symptom is not None:
                    found.append(symptom)
                    break
            if self.turbulence and key.category not in ("exp_avg", "exp_avg_sq"):
                watched = []
                if "norm" in index:
                    watched.append(("norm", "norm", row[index["norm"]]))
                pairs = [(op, row[index[op]]) for op in ("max", "min") if op in index]
                if pairs:
                    bad = [p for p in pairs if not math.isfinite(p[1])]
                    op, value = bad[0] if bad else max(pairs, key=lambda p: abs(p[1]))
                    watched.append(("peak", op, value))
                for magnitude, op, value in watched:
                    hkey = (key.category, key.name, key.vpp_stage, magnitude)
                    history = self.history(hkey)
                    for rule in self.turbulence:
                        symptom = rule.check(op, value, history)
                        if symptom is not None:
                            found.append(symptom)
                            break
                    if math.isfinite(value):
                        size = abs(value)
                        if history is not None and history > 0:
                            clip = self.turbulence[-1].factor
                            size = min(max(size, history / clip), history * clip)
                        total, count = step.get(hkey, (0.0, 0))
                        step[hkey] = (total + size, count + 1)
            if found:
                text = "; ".join(s.text for s in found)
                alerts.append((call_id, found[0].op, found[0].value, found[0].history, found[0].rule, text))
        for hkey, (total, count) in step.items():
            s, n = self.sums.get(hkey, (0.0, 0))
            self.sums[hkey] = ((1.0 - self.alpha) * s + self.alpha * total / count, n + 1)
        return alerts


def _random_step(rng: random.Random, keys: list[RowKey], level: float) -> list[list[float]]:
    rows = []
    for _ in keys:
        scale = level * rng.choice([1.0, 1.0, 1.0, 1.0, 5.0, 0.1])  # now and then a jump or a collapse
        row = [
            scale * rng.uniform(0.5, 1.5),
            -scale * rng.random(),
            scale * rng.random(),
            rng.gauss(0, 1),
            0.0,
            0.0,
            0.0,
        ]
        roll = rng.random()
        if roll < 0.03:
            row[0] = math.nan
            row[5] = float(rng.randint(1, 9))
        elif roll < 0.05:
            row[2] = math.inf
            row[6] = 1.0
        elif roll < 0.07:
            row[1] = -row[2]  # a tie between |min| and |max|: max is the peak
        elif roll < 0.09:
            row[0] = 0.0
        rows.append(row)
    return rows


def _keys(rng: random.Random) -> list[RowKey]:
    keys = [RowKey("grad_reduced", f"layer{i}.weight") for i in range(6)]
    keys += [RowKey("actv", f"layer{i}.output", 0, micro) for i in range(4) for micro in (0, 1)]
    keys += [RowKey("exp_avg", "layer0.weight"), RowKey("param_origin", "layer1.weight", 1)]
    keys += [RowKey("actv", "loop.cell.output", 0, 0)] * 3  # the same tensor three times in one step
    rng.shuffle(keys)
    return keys


def _same_nan(alert: tuple) -> tuple:
    """NaN compares unequal to a NaN read from elsewhere: compare it as a word."""
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in alert)


def _compare(rules_of, steps=40, seed=0, ops=OPS):
    rng = random.Random(seed)
    engine, reference = RuleEngine(rules_of()), RowByRow(rules_of())
    keys = _keys(rng)
    alerts = 0
    for step in range(steps):
        values = [[row[OPS.index(op)] for op in ops] for row in _random_step(rng, keys, level=1.0 + step / 10)]
        table = torch.tensor(values, dtype=torch.float64)
        got = engine.scan(keys, ops, values, None) if step % 2 else engine.scan(keys, ops, None, table)
        want = reference.scan(keys, ops, values)
        assert [_same_nan((a.call_id, a.op, a.value, a.history, a.rule, a.message)) for a in got] == [
            _same_nan(alert) for alert in want
        ], step
        alerts += len(want)
        for key in set(keys):
            for magnitude in ("norm", "peak"):
                hkey = (key.category, key.name, key.vpp_stage, magnitude)
                if key.category not in ("exp_avg", "exp_avg_sq"):
                    assert engine.history(*hkey) == reference.history(hkey), (step, hkey)
    assert alerts > steps // 4  # the steps did alert, of every kind the rows were made for
    return alerts


def test_a_step_checked_as_one_table_alerts_and_remembers_exactly_as_row_by_row():
    for seed in range(5):
        _compare(lambda: [AnomalyNan(), AnomalyTurbulence(1.0)], seed=seed)


def test_several_turbulence_rules_the_tightest_fires_and_the_loosest_clips():
    for seed in range(5):
        _compare(lambda: [AnomalyTurbulence(3.0), AnomalyNan(threshold=4.0), AnomalyTurbulence(0.5)], seed=seed)


def test_rows_without_min_max_or_without_norm_or_counts():
    for ops in (["norm", "mean"], ["min", "max", "nans"], ["max"], ["norm", "min"]):
        _compare(lambda: [AnomalyNan(threshold=3.0), AnomalyTurbulence(1.0)], steps=25, seed=7, ops=ops)


def test_the_history_is_exact_after_many_steps_where_the_bias_correction_reaches_one():
    _compare(lambda: [AnomalyTurbulence(2.0)], steps=150, seed=3)

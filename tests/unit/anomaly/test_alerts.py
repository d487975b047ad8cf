"""Alert rules: AnomalyNan and AnomalyTurbulence semantics, history, scope, and a healthy run."""

from __future__ import annotations

import json
import logging
import math

import torch

from conftest import ROOT
from msmon import TrainerMon
from msmon.anomaly.rules import EMA_ALPHA, WARMUP, AnomalyNan, AnomalyTurbulence, RuleEngine, build_rules
from msmon.config import parse_config
from msmon.records.rows import RowKey

OPS = ["norm", "min", "max", "mean", "nans", "infs"]
GRAD = RowKey("grad_reduced", "fc1.weight")


def row(norm=1.0, mn=-0.5, mx=0.5, mean=0.0, nans=0.0, infs=0.0) -> list[float]:
    return [norm, mn, mx, mean, nans, infs]


def feed(engine: RuleEngine, rows: list[list[float]], key: RowKey = GRAD):
    """One row per step; returns the alerts of each step."""
    return [engine.scan([key], OPS, [r]) for r in rows]


def warmed(threshold: float = 2.0, value: float = 1.0) -> RuleEngine:
    engine = RuleEngine([AnomalyTurbulence(threshold)])
    assert feed(engine, [row(norm=value, mn=-value / 2, mx=value / 2)] * WARMUP) == [[]] * WARMUP
    return engine


def test_turbulence_up_fires_only_beyond_one_plus_threshold_times_history():
    assert warmed(2.0).scan([GRAD], OPS, [row(norm=2.9)]) == []
    alerts = warmed(2.0).scan([GRAD], OPS, [row(norm=3.1)])
    assert [(a.rule, a.op, a.value, a.history) for a in alerts] == [("AnomalyTurbulence", "norm", 3.1, 1.0)]
    assert "3.1x its history 1" in alerts[0].message


def test_turbulence_down_fires_below_history_over_one_plus_threshold_even_for_large_thresholds():
    # threshold 2: a fall to less than a third is a collapse; a linear band (|x-h| > 2h) never could be
    assert warmed(2.0).scan([GRAD], OPS, [row(norm=0.34)]) == []
    alerts = warmed(2.0).scan([GRAD], OPS, [row(norm=0.32)])
    assert [(a.op, a.value) for a in alerts] == [("norm", 0.32)]
    assert warmed(0.5).scan([GRAD], OPS, [row(norm=0.7)]) == []
    assert len(warmed(0.5).scan([GRAD], OPS, [row(norm=0.6)])) == 1


def test_no_turbulence_alert_during_the_warm_up_however_large_the_jump():
    engine = RuleEngine([AnomalyTurbulence(0.5)])
    steps = feed(engine, [row(norm=10.0**i) for i in range(WARMUP)])
    assert steps == [[]] * WARMUP


def test_history_is_the_bias_corrected_ema_of_step_magnitudes():
    engine = RuleEngine([AnomalyTurbulence(100.0)])
    values = [1.0, 2.0, 4.0, 3.0, 5.0, 6.0]
    feed(engine, [row(norm=v) for v in values])
    # written out: s_n = (1-a) s_{n-1} + a x_n from s_0 = 0, h = s_n / (1 - (1-a)^n)
    s = 0.0
    for x in values:
        s = (1 - EMA_ALPHA) * s + EMA_ALPHA * x
    expected = s / (1 - (1 - EMA_ALPHA) ** len(values))
    assert math.isclose(engine.history("grad_reduced", "fc1.weight", 0, "norm"), expected)


def test_a_spike_neither_hides_the_next_one_nor_makes_the_return_look_like_a_collapse():
    engine = warmed(2.0)
    steps = feed(engine, [row(norm=50.0), row(norm=1.0), row(norm=1.0), row(norm=40.0)])
    assert [len(s) for s in steps] == [1, 0, 0, 1]


def test_a_lasting_level_change_is_absorbed_within_a_few_steps():
    engine = warmed(2.0)
    steps = feed(engine, [row(norm=10.0, mn=-5.0, mx=5.0)] * 12)
    fired = [i for i, s in enumerate(steps) if s]
    assert fired and fired[0] == 0 and fired[-1] < 6 and not any(steps[6:])


def test_turbulence_watches_the_peak_magnitude_not_min_and_max_each_near_zero():
    engine = warmed(2.0)
    # max drifts from 0.5 to 0.01 and min grows: the peak |x| stays ~0.5, nothing to report
    assert engine.scan([GRAD], OPS, [row(mn=-0.6, mx=0.01)]) == []
    alerts = engine.scan([GRAD], OPS, [row(mn=-0.4, mx=5.0)])
    assert [(a.op, a.value) for a in alerts] == [("max", 5.0)]


def test_mean_and_adam_moments_are_not_watched_by_turbulence():
    engine = warmed(0.5)
    assert engine.scan([GRAD], OPS, [row(mean=1e6)]) == []
    moment = RowKey("exp_avg_sq", "fc1.weight")
    steps = feed(engine, [row(norm=10.0**i) for i in range(2 * WARMUP)], key=moment)
    assert not any(steps)


def test_micro_steps_are_each_checked_against_the_history_of_earlier_steps():
    engine = RuleEngine([AnomalyTurbulence(2.0)])
    keys = [RowKey("actv", "fc1.output", 0, m) for m in range(2)]
    for _ in range(WARMUP):
        assert engine.scan(keys, OPS, [row(), row()]) == []
    alerts = engine.scan(keys, OPS, [row(), row(norm=8.0)])
    assert [(a.key.micro_step, a.call_id, a.op) for a in alerts] == [(1, 1, "norm")]


def test_nan_rule_reports_counts_first_and_folds_other_symptoms_into_one_alert_per_tensor():
    engine = RuleEngine([AnomalyNan()])
    alerts = engine.scan(
        [GRAD, RowKey("actv", "fc2.output")],
        OPS,
        [
            row(norm=math.nan, mn=math.nan, mx=math.nan, mean=math.nan, nans=3.0, infs=1.0),
            row(norm=math.inf, mx=math.inf, infs=2.0),
        ],
    )
    assert [(a.key.name, a.op, a.value, a.rule) for a in alerts] == [
        ("fc1.weight", "nans", 3.0, "AnomalyNan"),
        ("fc2.output", "infs", 2.0, "AnomalyNan"),
    ]
    assert alerts[0].message == "3 NaN values"


def test_nan_rule_without_count_ops_reports_the_non_finite_statistic():
    alerts = RuleEngine([AnomalyNan()]).scan([GRAD], ["norm", "max"], [[math.inf, math.inf]])
    assert [(a.op, a.value) for a in alerts] == [("norm", math.inf)]


def test_nan_rule_threshold_is_an_absolute_bound_on_norm_min_max():
    engine = RuleEngine([AnomalyNan(threshold=100.0)])
    assert engine.scan([GRAD], OPS, [row(norm=99.0, mn=-99.0, mx=99.0)]) == []
    alerts = engine.scan([GRAD], OPS, [row(norm=50.0, mn=-101.0, mx=3.0)])
    assert [(a.op, a.value) for a in alerts] == [("min", -101.0)]
    assert "> threshold 100" in alerts[0].message


def test_a_tensor_with_both_symptoms_is_one_alert_led_by_the_nan_rule():
    engine = RuleEngine([AnomalyTurbulence(2.0), AnomalyNan()])
    feed(engine, [row()] * WARMUP)
    alerts = engine.scan([GRAD], OPS, [row(norm=20.0, nans=1.0)])
    assert len(alerts) == 1 and alerts[0].rule == "AnomalyNan"
    assert "1 NaN value" in alerts[0].message and "20x its history" in alerts[0].message


def test_non_finite_values_never_enter_the_history():
    engine = warmed(2.0)
    feed(engine, [row(norm=math.inf, mx=math.inf)] * 3)
    assert math.isclose(engine.history("grad_reduced", "fc1.weight", 0, "norm"), 1.0)


def test_rules_are_built_from_the_msprobe_config_keys():
    cfg = parse_config(
        {
            "alert": {
                "rules": [
                    {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
                    {"rule_name": "AnomalyNan", "args": {"threshold": 1e4}},
                ]
            }
        }
    )
    rules = build_rules(cfg.alert.rules)
    assert [(type(r).__name__, r.threshold) for r in rules] == [("AnomalyTurbulence", 0.5), ("AnomalyNan", 1e4)]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_alert_lines_are_rate_limited_per_step_and_the_rest_counted(write_config, output_dir):
    from conftest import MLP

    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = TrainerMon(
        write_config(
            {
                "xy_distribution": True,
                "all_xy": True,
                "format": "csv",
                "ops": OPS,
                "alert": {"rules": [{"rule_name": "AnomalyNan"}], "max_lines_per_step": 2},
            }
        )
    )
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    handler = _Lines()
    logging.getLogger("msmon").addHandler(handler)
    try:
        model(torch.full((2, 8), math.nan)).sum().backward()
        optimizer.step()
        mon.close()
    finally:
        logging.getLogger("msmon").removeHandler(handler)
    alert_lines = [line for line in handler.lines if line.startswith("msmon alert")]
    assert len(alert_lines) == 3, alert_lines
    assert (
        "msmon alert [rank 0] step 0 micro-step 0 0:fc1.input:0/rank0/actv nans=16 history=none "
        "(AnomalyNan): 16 NaN values"
    ) in alert_lines[:2]
    assert alert_lines[2].startswith("msmon alert [rank 0] step 0: ") and "more alerts not shown" in alert_lines[2]


def train_tiny_gpt(config_path: str, steps: int, spike_step: int | None = None) -> tuple[TrainerMon, list[float]]:
    """The bundled tiny GPT (scaled down for CPU), AdamW, 2 micro-steps; at `spike_step` the
    gradients are made 20x larger (the loss is scaled in backward only)."""
    from tiny_gpt import TinyGPT, lm_loss, synthetic_batch

    torch.manual_seed(0)
    model = TinyGPT(d_model=64, n_layer=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(config_path)
    mon.set_monitor(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        for _ in range(2):
            loss = lm_loss(model, synthetic_batch(gen)) / 2
            (loss * (20.0 if step == spike_step else 1.0)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * 2)
    mon.close()
    return mon, losses


def bundled_config() -> dict:
    return json.loads((ROOT / "examples" / "monitor.json").read_text())


def test_a_healthy_50_step_run_with_the_bundled_alert_settings_raises_no_alert(write_config, output_dir):
    example = bundled_config()
    assert example["alert"]["rules"], "the bundled example config has alert rules"
    mon, losses = train_tiny_gpt(write_config(dict(example, format=["csv"])), 50)
    assert losses[-1] < losses[0] - 0.1, "the run trains"
    summary = mon.summary()
    assert summary["steps_recorded"] == 50
    assert summary["alerts"] == 0
    assert not (output_dir / "anomaly_detected" / "rank0" / "anomaly.jsonl").exists()


def test_a_gradient_spike_in_a_real_run_is_flagged_at_its_step_and_not_before(write_config, output_dir):
    example = bundled_config()
    cfg = {
        "xy_distribution": True,
        "all_xy": True,
        "wg_distribution": True,
        "format": ["csv"],
        "ops": example["ops"],
        "alert": dict(example["alert"], dump=True),
    }
    spike_step = 20
    mon, _ = train_tiny_gpt(write_config(cfg), spike_step + 1, spike_step)
    lines = (output_dir / "anomaly_detected" / "rank0" / "anomaly.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records and {r["step"] for r in records} == {spike_step}
    assert {r["rule"] for r in records} == {"AnomalyTurbulence"}
    assert {r["category"] for r in records} >= {"actv_grad", "grad_reduced"}
    assert "actv" not in {r["category"] for r in records}, "the forward pass was not touched"
    assert all(r["value"] > 3 * r["history"] for r in records)
    assert mon.summary()["alerts"] == len(records)

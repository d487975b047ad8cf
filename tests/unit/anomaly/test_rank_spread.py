"""AnomalyRankOutlier's parts that need no other rank: the robust spread test, what a rank
contributes (read from its step's rows), and the config (the kind
`msmon analyse` tells: test_fault_kind.py).
The exchange across ranks is tested end to end (tests/e2e/test_rank_outlier.py)."""

from __future__ import annotations

import math

import pytest
import torch

from msmon.anomaly.rank_spread import FLOOR, MAD_SCALE, departing, first_departing, spread
from msmon.anomaly.rules import AnomalyNan, build_rules
from msmon.collectors.rank_outlier.collector import rule_threshold
from msmon.collectors.rank_outlier.statistics import read_statistics
from msmon.config import ConfigError, parse_config
from msmon.records.rows import RowKey, StepRecord


# -- the spread ------------------------------------------------------------------------------------
def test_the_spread_is_the_median_and_1_4826_mads_computed_by_hand():
    values = [10.0, 12.0, 11.0, 40.0, 9.0]
    # sorted 9 10 11 12 40: median 11; |x - 11| = 1 1 0 29 2 -> sorted 0 1 1 2 29: MAD 1
    found = spread(values)
    assert found is not None
    assert found.median == 11.0 and found.scale == max(MAD_SCALE * 1.0, FLOOR * 11.0)
    assert found.score(40.0) == pytest.approx(29 / found.scale)
    assert departing(values, 5.0) == [3]


def test_three_close_healthy_ranks_do_not_make_a_fourth_healthy_one_an_outlier():
    values = [1.0, 1.01, 1.02, 1.3]  # MAD 0.01: without the floor rank 3 would be 19 deviations away
    found = spread(values)
    assert found is not None and found.scale == pytest.approx(FLOOR * 1.015)
    assert departing(values, 5.0) == []
    assert departing([1.0, 1.01, 1.02, 10.0], 5.0) == [3]


def test_fewer_than_three_finite_values_name_no_one():
    assert spread([1.0, 100.0]) is None and departing([1.0, 100.0], 5.0) == []
    assert departing([1.0, math.nan, 100.0, math.inf], 5.0) == []  # non-finite values are AnomalyNan's business
    assert departing([0.0, 0.0, 0.0, 0.0], 5.0) == []  # no scale to compare with


def test_the_first_departing_tensor_is_the_first_in_execution_order_else_the_most_departing():
    # tensors in execution order, each as its ranks' values; rank 2 departs in tensors 1 and 2
    columns = [[1.0, 1.1, 1.2, 1.05], [5.0, 5.1, 50.0, 4.9], [2.0, 2.1, 90.0, 1.9]]
    index, score = first_departing(columns, 2, 5.0) or (None, None)
    assert index == 1 and score == pytest.approx(abs(50.0 - 5.05) / (FLOOR * 5.05))
    mild = [[1.0, 1.1, 1.3, 1.05], [5.0, 5.1, 6.5, 4.9]]  # departing in none: the larger departure
    assert first_departing(mild, 2, 5.0)[0] == 1  # type: ignore[index]


# -- the config ------------------------------------------------------------------------------------
def test_the_rule_is_accepted_with_or_without_a_threshold_and_runs_outside_the_row_rules():
    cfg = parse_config({"alert": {"rules": [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyRankOutlier"}]}})
    assert rule_threshold(cfg) == 5.0
    assert [type(r) for r in build_rules(cfg.alert.rules)] == [AnomalyNan]  # compared across ranks, not per row
    tight = parse_config({"alert": {"rules": [{"rule_name": "AnomalyRankOutlier", "args": {"threshold": 3}}]}})
    assert rule_threshold(tight) == 3.0
    assert rule_threshold(parse_config({})) is None
    with pytest.raises(ConfigError, match="threshold"):
        parse_config({"alert": {"rules": [{"rule_name": "AnomalyRankOutlier", "args": {"threshold": 0}}]}})


# -- a rank's contribution -------------------------------------------------------------------------
def test_a_ranks_statistics_are_the_global_norms_of_its_activations_and_gradients_and_its_mean_loss():
    gen = torch.Generator().manual_seed(0)
    actv = {("fc1.input", 0): torch.randn(4, 8, generator=gen), ("fc1.output", 0): torch.randn(4, 3, generator=gen)}
    actv[("fc1.input", 1)] = torch.randn(4, 8, generator=gen)  # a second micro-step
    grads = {"fc1.weight": torch.randn(3, 8, generator=gen), "fc1.bias": torch.randn(3, generator=gen)}
    keys, rows = [], []
    for (name, micro), t in actv.items():
        keys.append(RowKey("actv", name, 0, micro))
        rows.append([t.norm().item(), t.max().item()])
    for name, g in grads.items():
        keys.append(RowKey("grad_unreduced", name))
        rows.append([g.norm().item(), g.max().item()])
    keys.append(RowKey("param_origin", "fc1.weight"))  # replicated: not a rank-local statistic
    rows.append([123.0, 1.0])
    record = StepRecord(4, 0, ["norm", "max"], keys, table=torch.tensor(rows, dtype=torch.float64))
    mine = read_statistics(record, 2.5)
    # independent: the norm of every value of the step's activations (or gradients) laid end to end
    all_actv = torch.cat([t.flatten() for t in actv.values()]).double()
    all_grads = torch.cat([g.flatten() for g in grads.values()]).double()
    assert mine.values["actv"] == pytest.approx(all_actv.norm().item(), rel=1e-6)
    assert mine.values["grad"] == pytest.approx(all_grads.norm().item(), rel=1e-6)
    assert mine.values["loss"] == 2.5
    # per tensor, over its micro-steps, in the order its first row came
    assert [n for n, _, _ in mine.tensors["actv"].names] == ["fc1.input", "fc1.output"]
    both = torch.cat([actv[("fc1.input", 0)].flatten(), actv[("fc1.input", 1)].flatten()]).double()
    assert mine.tensors["actv"].values[0] == pytest.approx(both.norm().item(), rel=1e-6)
    assert [c for _, _, c in mine.tensors["grad"].names] == [3, 4]  # their rows' call_ids
    without = read_statistics(StepRecord(4, 0, ["max"], keys, table=torch.tensor(rows).double()), None)
    assert all(math.isnan(v) for v in without.values.values())  # no norm recorded, no loss: all absent

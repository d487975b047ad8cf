"""The one median/MAD spread that AnomalyRankOutlier (anomaly/rank_spread.py) and the report's
robust z-scores (offline/results/robust.py) both use, each with its own floor, checked against
a plain-torch computation."""

from __future__ import annotations

import pytest
import torch

from msmon.anomaly import rank_spread
from msmon.anomaly.robust_spread import MAD_SCALE, robust_spread
from msmon.offline.results import robust


def torch_spread(values: list[float], floor: float) -> tuple[float, float]:
    """The spread in plain torch (float64; torch's median of an even count is the lower middle,
    so the middle pair is averaged by hand)."""
    x = torch.tensor(values, dtype=torch.float64)

    def median(t: torch.Tensor) -> float:
        s = t.sort().values
        n = s.numel()
        return float(s[n // 2]) if n % 2 else float((s[n // 2 - 1] + s[n // 2]) / 2)

    m = median(x)
    return m, max(1.4826 * median((x - m).abs()), floor * abs(m))


CASES = [[10.0, 12.0, 11.0, 40.0, 9.0], [1.0, 1.01, 1.02, 1.3], [-3.0, 5.0, 2.5, 2.0, 7.0, 100.0]]


@pytest.mark.parametrize("values", CASES)
@pytest.mark.parametrize("floor", [0.0, 1e-3, 0.15])
def test_the_spread_is_the_median_and_the_floored_1_4826_mads_of_plain_torch(values, floor):
    median, scale = robust_spread(values, floor)
    want_median, want_scale = torch_spread(values, floor)
    assert median == pytest.approx(want_median) and scale == pytest.approx(want_scale)


def test_the_floor_holds_the_scale_when_the_values_agree():
    assert robust_spread([2.0, 2.0, 2.0, 7.0], 0.15) == (2.0, pytest.approx(0.3))
    assert robust_spread([2.0, 2.0, 2.0, 7.0], 0.0) == (2.0, 0.0)


def test_the_rule_and_the_report_share_the_spread_and_differ_only_in_their_floor():
    assert rank_spread.MAD_SCALE == robust.MAD_SCALE == MAD_SCALE
    assert rank_spread.robust_spread is robust.robust_spread is robust_spread
    values = [1.0, 1.01, 1.02, 1.3]
    median, rule_scale = robust_spread(values, rank_spread.FLOOR)
    found = rank_spread.spread(values)
    assert found is not None and (found.median, found.scale) == (median, rule_scale)
    _, report_scale = robust_spread(values, robust.MAD_FLOOR)
    assert robust.robust_z(values) == [abs(v - median) / report_scale for v in values]
    assert report_scale < rule_scale  # the report ranks departures the rule's wide floor lets pass

"""AnomalyRankOutlier's test: which data-parallel rank's value leaves the ranks' robust spread.

With x_r the value of rank r, over the ranks whose value is finite, m their median and
MAD = median(|x_r - m|), rank r departs when

    |x_r - m| > k * s,    s = max(1.4826 * MAD, FLOOR * |m|)

1.4826 * MAD is the standard deviation of normally spread values, estimated so that a minority
of outliers cannot move it (a mean and a standard deviation follow the outlier they should
expose); anomaly/robust_spread.py computes m and s, the report's robust z-scores too (with a
narrower floor). k is the rule's `threshold` (DEFAULT_K = 5). The floor matters with few ranks:
three of four healthy values can lie close together by chance, MAD then is tiny and the fourth,
healthy too, would look far away; rank-local statistics of different batches differ by a
fraction of their size, so s is never below FLOOR (15 %) of |m|. With k = 5 a rank is named only
when its value is more than 0.75 |m| away from the median: above 1.75 times it, or below a
quarter of it (a rank fed zeros or a constant). Where the ranks' healthy spread is wider than
that (a few samples per rank: the loss of 8 samples can be twice that of 8 others), raise k. The
test needs MIN_RANKS (3) values: with two, neither is the odd one out (two ranks are told apart
by their own histories: rank_history.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .robust_spread import MAD_SCALE, robust_spread

__all__ = ["DEFAULT_K", "FLOOR", "MAD_SCALE", "MIN_RANKS", "Spread", "departing", "first_departing", "spread"]

DEFAULT_K = 5.0
FLOOR = 0.15
MIN_RANKS = 3


@dataclass(frozen=True)
class Spread:
    """The ranks' median and robust scale s of one statistic."""

    median: float
    scale: float

    def score(self, value: float) -> float:
        """How many scales `value` lies from the median (NaN for a non-finite value)."""
        if not math.isfinite(value):
            return math.nan
        return abs(value - self.median) / self.scale


def spread(values: Sequence[float]) -> Spread | None:
    """The spread of the finite values, or None when fewer than MIN_RANKS are finite or all
    are zero (no scale to compare with)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < MIN_RANKS:
        return None
    median, scale = robust_spread(finite, FLOOR)
    return Spread(median, scale) if scale > 0 else None


def departing(values: Sequence[float], k: float) -> list[int]:
    """The positions of the values that leave the spread (score > k), in order."""
    found = spread(values)
    if found is None:
        return []
    return [i for i, v in enumerate(values) if found.score(v) > k]


def first_departing(columns: Sequence[Sequence[float]], position: int, k: float) -> tuple[int, float] | None:
    """Where rank `position` departs first among tensors given in execution order, each as its
    ranks' values: the first tensor whose value leaves its own spread (score > k), else the one
    it departs from most; (tensor index, score), or None when no tensor has a spread."""
    best: tuple[int, float] | None = None
    for index, values in enumerate(columns):
        found = spread(values)
        if found is None:
            continue
        score = found.score(values[position])
        if math.isnan(score):
            continue
        if score > k:
            return index, score
        if best is None or score > best[1]:
            best = (index, score)
    return best

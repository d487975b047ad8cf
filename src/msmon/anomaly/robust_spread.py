"""The robust spread of a set of values: their median and a scale that outliers cannot move.

One definition for the live AnomalyRankOutlier (anomaly/rank_spread.py) and the report's robust
z-scores over ranks (offline/results/robust.py), so that a rank the rule names and a rank the
report ranks first are measured alike. A mean and a standard deviation follow the very value one
looks for; the median and the median absolute deviation (MAD) do not while fewer than half the
values depart. 1.4826 * MAD estimates the standard deviation of normally spread values (a normal
distribution's MAD is 0.6745 of one). The scale is floored at a fraction of |median| given by the
caller: the rule, with few ranks of different batches, needs a wide floor; the report, comparing
ranks that may agree to the last digit, a narrow one. Torch-free: the offline readers import it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

MAD_SCALE = 1.4826


def robust_spread(values: Iterable[float], floor: float) -> tuple[float, float]:
    """(median, max(MAD_SCALE * MAD, floor * |median|)) of `values`: non-empty and finite (the
    callers drop the others, each by its own rule)."""
    values = list(values)
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return median, max(MAD_SCALE * mad, floor * abs(median))

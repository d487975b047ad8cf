"""How far a rank departs from the others: the robust z-score over ranks (median and MAD).

A mean and a standard deviation are pulled by the very rank one is looking for; the median and
the median absolute deviation (MAD) are not, as long as fewer than half the ranks depart. The
MAD is scaled by 1.4826 (a normal distribution's MAD is 0.6745 standard deviations) and floored
at 0.1 % of |median|, so that ranks which agree to the last digit do not make a rounding
difference look like an outlier. robust_z is anomaly/robust_spread.py's spread with that floor
(the live AnomalyRankOutlier's, with a wider one); rank_stats.py the same over numpy arrays.
"""

from __future__ import annotations

from ...anomaly.robust_spread import MAD_SCALE, robust_spread

__all__ = ["MAD_FLOOR", "MAD_SCALE", "TINY", "robust_z"]

MAD_FLOOR = 1e-3  # of |median|
TINY = 1e-30


def robust_z(values: list[float]) -> list[float]:
    """Each value's |value - median| in robust standard deviations of the values."""
    if not values:
        return []
    med, scale = robust_spread(values, MAD_FLOOR)
    scale = max(scale, TINY)
    return [abs(v - med) / scale for v in values]

"""How far a rank departs from the others: the robust z-score over ranks (median and MAD).

A mean and a standard deviation are pulled by the very rank one is looking for; the median and
the median absolute deviation (MAD) are not, as long as fewer than half the ranks depart. The
MAD is scaled by 1.4826 (a normal distribution's MAD is 0.6745 standard deviations) and floored
at 0.1 % of |median|, so that ranks which agree to the last digit do not make a rounding
difference look like an outlier.
"""

from __future__ import annotations

import statistics

MAD_SCALE = 1.4826
MAD_FLOOR = 1e-3  # of |median|
TINY = 1e-30

# the same in SQL, for `dev` (|value - med|), `mad` and `med` columns
SQL_Z = f"dev / greatest({MAD_SCALE} * mad, {MAD_FLOOR} * abs(med), {TINY})"


def robust_z(values: list[float]) -> list[float]:
    """Each value's |value - median| in robust standard deviations of the values."""
    if not values:
        return []
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    scale = max(MAD_SCALE * mad, MAD_FLOOR * abs(med), TINY)
    return [abs(v - med) / scale for v in values]

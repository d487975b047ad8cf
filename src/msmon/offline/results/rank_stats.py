"""Medians and robust z-scores over the rank axis (the first) of numpy arrays, NaN skipped.

The report's row charts (rank_points.py) and its per-rank outliers (rank_outliers.py) both ask
how far each rank lies from the others: robust.py's rule (median, MAD scaled by 1.4826 and
floored at a share of |median|) over arrays of every cell at once.
"""

from __future__ import annotations

import numpy as np

from .robust import MAD_FLOOR, MAD_SCALE, TINY


def median_over_ranks(v: np.ndarray) -> np.ndarray:
    """The median over the first axis of the values that are not NaN (NaN where none is), as
    DuckDB's median: the mean of the middle two of an even count. The ranks are made the last,
    contiguous axis first (a partition along the first axis reads one value per cache line);
    cells with a NaN are sorted, NaN last, and take the middle of what precedes it."""
    n = v.shape[0]
    if n == 0:
        return np.full(v.shape[1:], np.nan)
    ranks_last = np.moveaxis(v, 0, -1)
    part = np.array(ranks_last, order="C")  # always a copy: partitioned in place
    holes = np.isnan(part).any(axis=-1)
    middle = [(n - 1) // 2, n // 2]
    part.partition(middle, axis=-1)
    out = part[..., n // 2].copy() if n % 2 else np.mean(part[..., middle], axis=-1)
    if holes.any():
        x = np.sort(ranks_last[holes], axis=-1)
        k = np.count_nonzero(~np.isnan(x), axis=-1)
        rows = np.arange(x.shape[0])
        low, high = x[rows, np.maximum(k - 1, 0) // 2], x[rows, np.maximum(k, 1) // 2]
        mean = np.mean(np.stack([low, high], axis=-1), axis=-1)
        out[holes] = np.where(k == 0, np.nan, np.where(k % 2 == 1, high, mean))
    return np.asarray(out)


def robust_z(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z, median, MAD): each value's |value - median| over the first axis in robust standard
    deviations (NaN where the value is NaN), and the median and MAD of each cell."""
    med = median_over_ranks(v)
    dev = np.abs(v - med)
    mad = median_over_ranks(dev)
    return dev / np.fmax(np.fmax(MAD_SCALE * mad, MAD_FLOOR * np.abs(med)), TINY), med, mad

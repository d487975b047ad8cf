"""Medians and robust z-scores over the rank axis (the first) of numpy arrays, NaN skipped.

The report's row charts (rank_points.py) and its per-rank outliers (rank_outliers.py) both ask
how far each rank lies from the others: robust.py's rule (median, MAD scaled by 1.4826 and
floored at a share of |median|) over arrays of every cell at once.
"""

from __future__ import annotations

import warnings

import numpy as np

from .robust import MAD_FLOOR, MAD_SCALE, TINY


def median_over_ranks(v: np.ndarray) -> np.ndarray:
    """The median over the first axis of the values that are not NaN (NaN where none is), as
    DuckDB's median: the mean of the middle two of an even count. np.median, and np.nanmedian
    (several times slower) only over the cells where a value is NaN."""
    out = np.median(v, axis=0)  # NaN where a value is NaN
    holes = np.isnan(out)
    if holes.any():
        with warnings.catch_warnings():  # "All-NaN slice": a cell no rank has a finite value in
            warnings.simplefilter("ignore", RuntimeWarning)
            out[holes] = np.nanmedian(v[:, holes], axis=0)
    return out


def robust_z(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z, median, MAD): each value's |value - median| over the first axis in robust standard
    deviations (NaN where the value is NaN), and the median and MAD of each cell."""
    med = median_over_ranks(v)
    dev = np.abs(v - med)
    mad = median_over_ranks(dev)
    return dev / np.fmax(np.fmax(MAD_SCALE * mad, MAD_FLOOR * np.abs(med)), TINY), med, mad

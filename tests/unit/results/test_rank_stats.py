"""The median over ranks (rank_stats.py) against numpy's own nanmedian, and the input left as it
was: the report's per-rank outliers pass arrays whose rank axis is already the last in memory."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from msmon.offline.results.rank_stats import median_over_ranks


def _nanmedian(v: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # "All-NaN slice": NaN there, as wanted
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(v, axis=0)


@pytest.mark.parametrize("shape", [(1, 4), (2, 3), (5, 4, 3), (6, 2, 3, 4), (511, 3, 5), (512, 7, 4, 3)])
@pytest.mark.parametrize("nan_share", [0.0, 0.01, 0.3, 1.0])
def test_the_median_over_ranks_is_numpys_nanmedian(shape, nan_share):
    rng = np.random.default_rng(len(shape) * 100 + shape[0])
    v = rng.normal(size=shape) * 1e3
    v[rng.random(shape) < nan_share] = np.nan
    v[:, 0] = np.nan  # a cell no rank has a value in
    got = median_over_ranks(v)
    assert got.shape == shape[1:]
    assert np.array_equal(got, _nanmedian(v), equal_nan=True)


def test_the_median_over_ranks_leaves_an_array_with_the_ranks_last_in_memory_as_it_was():
    rng = np.random.default_rng(7)
    cells_by_rank = rng.normal(size=(40, 9))  # C order: each cell's ranks side by side
    cells_by_rank[3, 2] = np.nan
    v = cells_by_rank.T  # (ranks, cells), as the per-rank outliers pass it
    before = v.copy()
    median_over_ranks(v)
    assert np.array_equal(v, before, equal_nan=True)

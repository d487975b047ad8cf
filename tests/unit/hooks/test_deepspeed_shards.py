"""Statistics of a tensor split across ranks, combined from its pieces' statistics, equal the
statistics of the whole tensor; and the DeepSpeed instrumentor wraps `deepspeed.initialize`."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import ALL_OPS
from msmon import TrainerMon
from msmon.runtime.shards import combine_gathered
from msmon.stats.engine import batch_stats


def split(t: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    flat = t.reshape(-1)
    bounds = [0, *cuts, flat.numel()]
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize(
    "cuts", [[30], [0, 17], [17, 17, 64], [64]], ids=["halves", "empty-first", "empty-middle", "empty-last"]
)
def test_pieces_combine_exactly_into_the_whole_tensors_statistics(cuts):
    torch.manual_seed(0)
    tensors = [torch.randn(8, 8), torch.randn(64) * 1e-3, torch.zeros(64)]
    tensors[0][2, 3] = 0.0  # a zero for the zero fraction
    ranks = len(cuts) + 1
    rows = torch.stack([batch_stats([split(t, cuts)[r] for t in tensors], ALL_OPS, 1e-8) for r in range(ranks)])
    counts = torch.tensor([[split(t, cuts)[r].numel() for t in tensors] for r in range(ranks)])
    combined = combine_gathered(rows, counts, ALL_OPS)
    whole = batch_stats(tensors, ALL_OPS, 1e-8)
    torch.testing.assert_close(combined, whole, rtol=1e-6, atol=1e-12)


def test_a_nan_in_one_piece_shows_in_the_combined_statistics():
    t = torch.randn(10)
    t[7] = math.nan
    pieces = split(t, [5])
    rows = torch.stack([batch_stats([p], ALL_OPS, 1e-8) for p in pieces])
    combined = combine_gathered(rows, torch.tensor([[5], [5]]), ALL_OPS)[0]
    assert combined[ALL_OPS.index("nans")] == 1
    assert math.isnan(combined[ALL_OPS.index("norm")])


def test_a_tensor_empty_on_every_rank_gives_a_nan_row():
    rows = torch.stack([batch_stats([torch.empty(0)], ALL_OPS, 1e-8) for _ in range(2)])
    combined = combine_gathered(rows, torch.zeros(2, 1), ALL_OPS)
    assert torch.isnan(combined).all()


def test_deepspeed_initialize_is_wrapped_while_instrumented_and_restored_after(write_config):
    import deepspeed

    from msmon.hooks import Session
    from msmon.hooks import deepspeed as ds_hook

    original = deepspeed.initialize
    ds_hook.instrument(Session.from_file(write_config({}), TrainerMon))
    try:
        assert deepspeed.initialize is not original
        assert deepspeed.initialize.__wrapped__ is original
    finally:
        ds_hook.uninstrument()
    assert deepspeed.initialize is original

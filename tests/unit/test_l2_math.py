"""The L2 feature math (msmon.collectors.l2_features.tensor_math) against direct computations:
svdvals/matrix_norm for the spectral norm, the full softmax over every head for attention, the
explicit cosine matrix for MoE router weights."""

from __future__ import annotations

import math

import pytest
import torch

import l2_reference as direct
from msmon.collectors.l2_features import tensor_math as M


def seed(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return M.seed_basis(n, torch.Generator().manual_seed(seed), torch.device("cpu"), dtype)


def with_spectrum(rows: int, cols: int, singular: list[float], seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(singular), generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, len(singular), generator=gen, dtype=torch.float64))
    return (u * torch.tensor(singular, dtype=torch.float64)) @ v.T


# -- spectral norm, stable rank ----------------------------------------------------------------
def test_spectral_norm_matches_matrix_norm_ord_2_on_a_weight_with_a_spectral_gap():
    w = with_spectrum(48, 32, [6.0, 3.0] + torch.linspace(2.0, 0.1, 30).tolist()).float()
    sigma, basis = M.spectral_norm(w, seed(32), M.COLD_ITERATIONS)
    assert float(sigma) == pytest.approx(float(torch.linalg.matrix_norm(w.double(), ord=2)), rel=1e-6)
    assert basis.shape == (32, M.BLOCK)
    assert torch.allclose(basis.T @ basis, torch.eye(M.BLOCK), atol=1e-5)


def test_warm_started_spectral_norm_converges_on_a_random_weight_and_never_overshoots():
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(3))  # σ₂/σ₁ = 0.989
    sigma1 = float(torch.linalg.svdvals(w.double())[0])
    sigma, basis = M.spectral_norm(w, seed(64), M.COLD_ITERATIONS)
    errors = [(sigma1 - float(sigma)) / sigma1]
    for _ in range(10):  # one call per training step, from the previous step's vectors
        sigma, basis = M.spectral_norm(w, basis, M.WARM_ITERATIONS)
        errors.append((sigma1 - float(sigma)) / sigma1)
    assert all(e > -1e-6 for e in errors)  # a Ritz value never exceeds σ₁
    assert errors[0] < 1e-3 and errors[-1] < 1e-6


def test_a_crossing_of_the_top_singular_values_is_tracked_step_by_step():
    """The top two singular values trade places over 20 steps: a single warm-started vector
    would stay with the direction that falls; the block keeps both directions."""
    gen = torch.Generator().manual_seed(12)
    u, _ = torch.linalg.qr(torch.randn(40, 10, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 10, generator=gen, dtype=torch.float64))
    rest = [1.5, 1.2, 1.0, 0.8, 0.6, 0.5, 0.4, 0.3]
    basis, iterations = seed(30), M.COLD_ITERATIONS
    for t in range(21):
        s = torch.tensor([3.0 - t / 20, 2.0 + t / 20] + rest, dtype=torch.float64)
        w = ((u * s) @ v.T).float()
        sigma, basis = M.spectral_norm(w, basis, iterations)
        iterations = M.WARM_ITERATIONS
        assert float(sigma) == pytest.approx(float(s.max()), rel=1e-5), t


def test_half_precision_weight_is_estimated_without_a_float_copy_to_a_thousandth():
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    basis, iterations = seed(128), M.COLD_ITERATIONS
    for _ in range(5):
        sigma, basis = M.spectral_norm(w, basis, iterations)
        iterations = M.WARM_ITERATIONS
    assert float(sigma) == pytest.approx(float(torch.linalg.matrix_norm(w.double(), ord=2)), rel=2e-3)


def test_stable_rank_is_frobenius_squared_over_spectral_norm_squared():
    w = with_spectrum(40, 30, [4.0, 2.0, 1.0])
    s = torch.linalg.svdvals(w)
    sr = M.stable_rank(M.frobenius_norm(w), torch.linalg.matrix_norm(w, ord=2))
    assert float(sr) == pytest.approx(float((s**2).sum() / s[0] ** 2), rel=1e-12)  # 21/16
    assert float(M.stable_rank(M.frobenius_norm(torch.eye(7)), torch.tensor(1.0))) == pytest.approx(7.0)
    rank_one = torch.outer(torch.arange(1.0, 5.0), torch.arange(1.0, 4.0))  # fewer columns than BLOCK
    sigma, _ = M.spectral_norm(rank_one, seed(3), M.COLD_ITERATIONS)
    assert float(sigma) == pytest.approx(float(torch.linalg.matrix_norm(rank_one, ord=2)), rel=1e-6)
    assert float(M.stable_rank(M.frobenius_norm(rank_one), sigma)) == pytest.approx(1.0, rel=1e-5)


def test_zero_and_non_finite_weights_give_zero_and_nan_and_keep_the_vectors_for_the_next_step():
    start = seed(4)
    sigma, basis = M.spectral_norm(torch.zeros(5, 4), start, 3)
    assert float(sigma) == 0.0 and torch.equal(basis, start)
    assert float(M.stable_rank(M.frobenius_norm(torch.zeros(5, 4)), sigma)) == 0.0
    good = with_spectrum(5, 4, [2.0, 1.0, 0.5]).float()
    _, basis = M.spectral_norm(good, start, M.COLD_ITERATIONS)
    bad = good.clone()
    bad[2, 1] = float("nan")
    sigma, kept = M.spectral_norm(bad, basis, M.WARM_ITERATIONS)
    assert math.isnan(float(sigma)) and torch.equal(kept, basis)
    assert math.isnan(float(M.stable_rank(M.frobenius_norm(bad), sigma)))
    sigma, _ = M.spectral_norm(good, kept, M.WARM_ITERATIONS)  # the next finite step is exact again
    assert float(sigma) == pytest.approx(2.0, rel=1e-6)


def test_orthonormalize_and_top_eigenvalue_against_linalg():
    x = torch.randn(50, 6, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    q = M.orthonormalize(x)
    assert torch.allclose(q.T @ q, torch.eye(6, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(q @ (q.T @ x), x, atol=1e-10)  # the same span
    deficient = M.orthonormalize(torch.cat([x[:, :2], x[:, :1] * 2], dim=1))
    assert torch.linalg.eigvalsh(deficient.T @ deficient).max() <= 1 + 1e-9
    b = x.T @ x
    assert float(M.top_eigenvalue(b)) == pytest.approx(float(torch.linalg.eigvalsh(b)[-1]), rel=1e-12)


# -- attention --------------------------------------------------------------------------------
def layout(x_bhsd: torch.Tensor, order: str) -> torch.Tensor:
    return {"s,b,h,d": x_bhsd.permute(2, 0, 1, 3), "b,s,h,d": x_bhsd.permute(0, 2, 1, 3), "b,h,s,d": x_bhsd}[
        order
    ].contiguous()


@pytest.mark.parametrize("order", ["s,b,h,d", "b,s,h,d", "b,h,s,d"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_over_every_row_equals_the_full_softmax_entropy_over_all_heads(order, kv_heads):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 9, 8, generator=gen) * 2
    k = torch.randn(3, kv_heads, 9, 8, generator=gen) * 2
    entropy, top = M.attention_features(layout(q, order), layout(k, order), order, None)
    want_entropy, want_top = direct.attention(q, k)
    assert float(entropy) == pytest.approx(want_entropy, rel=1e-5)
    assert float(top) == pytest.approx(want_top, rel=1e-5)


def test_attention_with_more_keys_than_queries_masks_at_the_end():
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 2, 5, 4, generator=gen), torch.randn(2, 2, 8, 4, generator=gen)
    entropy, top = M.attention_features(q, k, "b,h,s,d", None)
    assert (float(entropy), float(top)) == pytest.approx(direct.attention(q, k), rel=1e-5)


def test_sampled_rows_give_the_direct_computation_over_exactly_those_rows():
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(4, 6, 50, 8, generator=gen), torch.randn(4, 3, 50, 8, generator=gen)
    used, rows = M.attention_rows(4, 6, 50, 50, rows_per_head=12)
    assert (used, rows) == (4, 3)
    positions = M.sample_positions(6, 50, rows, torch.Generator().manual_seed(11), torch.device("cpu"))
    entropy, top = M.attention_features(layout(q, "s,b,h,d"), layout(k, "s,b,h,d"), "s,b,h,d", positions, used)
    assert (float(entropy), float(top)) == pytest.approx(direct.attention(q, k, positions), rel=1e-5)
    # fewer batch elements than the batch: only the first `used` are read
    entropy, _ = M.attention_features(q, k, "b,h,s,d", positions, 2)
    assert float(entropy) == pytest.approx(direct.attention(q, k, positions, batches=2)[0], rel=1e-5)


def test_the_row_sample_is_fixed_by_its_seed_distinct_within_a_head_and_different_across_heads():
    def draw(seed):
        return M.sample_positions(8, 100, 5, torch.Generator().manual_seed(seed), torch.device("cpu"))

    a, b = draw(3), draw(3)
    assert torch.equal(a, b) and not torch.equal(a, draw(4))
    assert a.shape == (8, 5)
    for head in a.tolist():
        assert len(set(head)) == 5 and head == sorted(head) and all(0 <= i < 100 for i in head)
    assert len({tuple(h) for h in a.tolist()}) > 1
    assert M.sample_positions(8, 5, 5, None, torch.device("cpu")) is None  # short sequences: every row


def test_the_attention_score_block_stays_within_its_budget():
    for batch, heads, seq in [(8, 32, 4096), (1, 32, 32768), (64, 16, 2048), (2, 4, 12)]:
        used, rows = M.attention_rows(batch, heads, seq, seq)
        assert rows * used <= M.ATTENTION_ROWS and rows <= seq
        assert used * heads * rows * seq <= max(M.ATTENTION_BUDGET, heads * seq)
    assert M.attention_rows(2, 4, 12, 12) == (2, 12)  # a short sequence: every row of every batch element


def test_a_layout_that_does_not_fit_is_a_value_error():
    with pytest.raises(ValueError, match="4-D"):
        M.attention_features(torch.randn(4, 8), torch.randn(4, 8), "s,b,h,d", None)
    with pytest.raises(ValueError, match="do not fit"):
        M.attention_features(torch.randn(5, 2, 3, 8), torch.randn(5, 2, 2, 8), "s,b,h,d", None)


# -- MoE --------------------------------------------------------------------------------------
def test_router_weight_similarity_is_the_mean_of_the_explicit_cosine_matrix():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(6, 16, generator=gen) + 0.7  # [experts, hidden], as nn.Linear(16, 6).weight
    w[4] = 0.0  # an expert whose vector is zero: cosine 0 with every other, as F.normalize gives
    assert float(M.router_weight_similarity(w, 0)) == pytest.approx(direct.mean_cosine(w), rel=1e-6)
    assert float(M.router_weight_similarity(w.T.contiguous(), 1)) == pytest.approx(direct.mean_cosine(w), rel=1e-6)
    assert float(M.router_weight_similarity(torch.ones(3, 5), 0)) == pytest.approx(1.0)
    assert math.isnan(float(M.router_weight_similarity(torch.ones(1, 5), 0)))


def test_the_expert_axis_is_the_one_of_the_router_output_length_else_the_shorter():
    assert M.expert_axis(torch.Size([6, 16]), 6) == 0
    assert M.expert_axis(torch.Size([16, 6]), 6) == 1
    assert M.expert_axis(torch.Size([64, 32]), 64) == 0  # more experts than hidden units: the output decides
    assert M.expert_axis(torch.Size([16, 6]), None) == 1
    assert M.expert_axis(torch.Size([8, 8]), 8) == 0


def test_router_logit_entropy_is_the_mean_per_token_entropy_over_experts():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 5, 6, generator=gen) * 3  # [batch, seq, experts]
    p = torch.softmax(logits.double(), dim=-1)
    assert float(M.router_logit_entropy(logits)) == pytest.approx(float((-(p * p.log()).sum(-1)).mean()), rel=1e-5)
    masked = logits.clone()
    masked[..., 2] = float("-inf")  # an expert masked out adds nothing
    rest = torch.softmax(logits[..., [0, 1, 3, 4, 5]].double(), dim=-1)
    assert float(M.router_logit_entropy(masked)) == pytest.approx(
        float((-(rest * rest.log()).sum(-1)).mean()), rel=1e-5
    )
    masked[0, 0, 0] = float("nan")  # a NaN logit is reported, not hidden
    assert math.isnan(float(M.router_logit_entropy(masked)))


# -- no host reads ------------------------------------------------------------------------------
def test_every_feature_runs_on_the_meta_device_so_none_reads_a_value_on_the_host():
    meta = torch.device("meta")
    w, v = torch.empty(64, 32, device=meta), torch.empty(32, 8, device=meta)
    sigma, v2 = M.spectral_norm(w, v, 3)
    outs = [
        sigma,
        v2,
        M.seed_basis(32, None, meta, torch.float32),
        M.stable_rank(M.frobenius_norm(w), sigma),
        M.usable(sigma),
        M.router_weight_similarity(w, 1),
        M.router_logit_entropy(torch.empty(10, 6, device=meta)),
    ]
    q, k = torch.empty(16, 2, 4, 8, device=meta), torch.empty(16, 2, 2, 8, device=meta)
    positions = torch.empty(4, 5, dtype=torch.long, device=meta)
    outs += list(M.attention_features(q, k, "s,b,h,d", positions, 2))
    outs += list(M.attention_features(q, k, "s,b,h,d", None))
    assert all(t.device.type == "meta" for t in outs)

"""The L2 features (`recording_l2_features`) as pure tensor functions.

Every function here reads its inputs, never writes them, and returns 0-d float tensors on the
inputs' device without reading a value on the host (no `.item()`, no boolean-mask indexing,
no data-dependent branch), so a hook can call it without synchronising with the device. The
collector (collector.py) owns the state (warm-start vectors, sampled rows).

- Spectral norm ``σ₁(W) = ‖W‖₂`` by power iteration on WᵀW over a block of BLOCK vectors
  (subspace iteration with a Rayleigh–Ritz estimate), warm-started from the previous step's
  vectors; stable rank ``‖W‖²_F / ‖W‖²₂``.
- Attention entropy ``H = −Σⱼ pⱼ log pⱼ`` and ``max_j pⱼ`` of ``p = softmax(q·Kᵀ/√d)`` under a
  causal mask, averaged over a fixed sample of query rows of every head.
- MoE router weight similarity: the mean cosine similarity over all pairs of expert vectors.
- MoE router logit entropy: the mean over tokens of the entropy of the softmax over experts.
"""

from __future__ import annotations

import math

import torch

from ...config import SA_ORDERS

ATTENTION_ROWS = 32  # query rows sampled per head (fewer when the score block would exceed the budget)
ATTENTION_BUDGET = 1 << 22  # score elements per call: 16 MiB of float32
BLOCK = 8  # vectors of the subspace iteration: a crossing of the top singular values stays tracked
COLD_ITERATIONS = 32  # subspace iterations the first time a weight is seen
WARM_ITERATIONS = 1  # per step after that, from the previous step's vectors: two reads of W
_TINY = 1e-30


def _vector_dtype(w: torch.Tensor) -> torch.dtype:
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def frobenius_norm(w: torch.Tensor) -> torch.Tensor:
    """‖W‖_F, accumulated in float32 (float64 for float64 weights); no float copy of W."""
    return torch.linalg.vector_norm(w.detach(), dtype=_vector_dtype(w))


def seed_basis(n: int, generator: torch.Generator | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[n, min(BLOCK, n)] orthonormal start vectors drawn from `generator` on the device."""
    return orthonormalize(torch.randn(n, min(BLOCK, n), generator=generator, device=device, dtype=dtype))


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of span(x) (Cholesky QR in float64; cholesky_ex checks nothing on
    the host). Directions x barely spans shrink towards 0 rather than grow: VᵀV <= I."""
    x64 = x.double()
    gram = x64.T @ x64
    gram.diagonal().add_(gram.diagonal().sum() * 1e-12 + _TINY)
    lower, _ = torch.linalg.cholesky_ex(gram)
    return torch.linalg.solve_triangular(lower, x64.T, upper=False).T.to(x.dtype)


def top_eigenvalue(b: torch.Tensor) -> torch.Tensor:
    """The largest eigenvalue of a small symmetric positive semi-definite matrix, without an
    eigensolver (which would synchronise): X = B^4096, normalised as it is raised, is all but
    the projector on the top eigenvector, and trace(BX)/trace(X) its eigenvalue (the others
    weigh (λᵢ/λ₁)^4096: 1.7% for λᵢ = 0.999 λ₁, so the error is below 2e-5 λ₁)."""
    x = b / b.diagonal().sum().clamp_min(_TINY)
    for _ in range(3):
        x = torch.linalg.matrix_power(x, 16)  # the top eigenvalue of x stays >= 1/k^16: no underflow
        x = x / x.diagonal().sum().clamp_min(_TINY)
    return (b * x).sum() / x.diagonal().sum().clamp_min(_TINY)


def spectral_norm(w: torch.Tensor, basis: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(estimate of ‖W‖₂, the next basis) for a 2-D W from an orthonormal basis [n, k] of
    start vectors (n = W.shape[1]).

    Subspace iteration: `iterations − 1` times V ← orth(WᵀW V); then U = W V, σ² = the top
    eigenvalue of UᵀU (Rayleigh–Ritz: the best estimate within span V, never above ‖W‖²₂),
    and the next basis orth(WᵀU). A warm step (iterations = 1) reads W twice. Where σ is not
    `usable` (W all zero or not finite) the given basis is returned to start from next time.
    Products run in W's dtype (no float copy of a half-precision W), the k×k part in float64.
    """
    w = w.detach()
    v = basis
    for _ in range(max(int(iterations), 1) - 1):
        v = orthonormalize(_mm(w.T, _mm(w, v, basis.dtype), basis.dtype))
    u = _mm(w, v, basis.dtype)
    u64 = u.double()
    sigma = top_eigenvalue(u64.T @ u64).clamp_min(0).sqrt().to(basis.dtype)
    following = orthonormalize(_mm(w.T, u, basis.dtype))
    keep = usable(sigma) & torch.isfinite(following).all()
    return sigma, torch.where(keep, following, basis)


def _mm(w: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.mm(w, x.to(w.dtype)).to(out_dtype)


def usable(sigma: torch.Tensor) -> torch.Tensor:
    """Whether a step's vectors can seed the next step (0-d bool, on the device)."""
    return torch.isfinite(sigma) & (sigma > 0)


def stable_rank(fro: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """‖W‖²_F / ‖W‖²₂ (between 1 and rank(W)); 0 for an all-zero W, NaN for a non-finite one."""
    ratio = (fro / sigma.clamp_min(_TINY)) ** 2
    return torch.where(sigma > 0, ratio, torch.where(torch.isfinite(sigma), torch.zeros_like(ratio), sigma))


def to_bhsd(x: torch.Tensor, order: str) -> torch.Tensor:
    """A [batch, heads, seq, dim] view of a q or k laid out as `order` (one of SA_ORDERS)."""
    if x.dim() != 4:
        raise ValueError(f"expected a 4-D tensor laid out as {order}, got shape {tuple(x.shape)}")
    if order == "s,b,h,d":
        return x.permute(1, 2, 0, 3)
    if order == "b,s,h,d":
        return x.permute(0, 2, 1, 3)
    if order == "b,h,s,d":
        return x
    raise ValueError(f"unknown attention layout {order!r}; expected one of {list(SA_ORDERS)}")


def attention_rows(batch: int, heads: int, sq: int, sk: int, rows_per_head: int | None = None) -> tuple[int, int]:
    """(batch elements used, query rows per head and batch element) for a score block of at
    most ATTENTION_BUDGET elements and at most ATTENTION_ROWS rows per head (all rows when
    the sequence is that short). rows_per_head overrides the cap (tests: every row)."""
    cap = rows_per_head
    if cap is None:
        cap = max(1, min(ATTENTION_ROWS, ATTENTION_BUDGET // max(heads * sk, 1)))
    used = min(batch, cap)
    return used, max(1, min(sq, cap // used))


def sample_positions(
    heads: int, sq: int, rows: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor | None:
    """[heads, rows] distinct query positions per head, drawn from `generator` on the device
    (no host-to-device copy); None when every row is used."""
    if rows >= sq:
        return None
    keys = torch.rand(heads, sq, generator=generator, device=device)
    return keys.topk(rows, dim=1).indices.sort(dim=1).values


def attention_features(
    q: torch.Tensor, k: torch.Tensor, order: str, positions: torch.Tensor | None, batch_used: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean entropy, mean softmax max) of causal attention rows, over every head.

    q: [.., hq, .., d] and k: [.., hkv, .., d] in layout `order`; hq a multiple of hkv (grouped
    query attention: query head i reads key head i // (hq/hkv)). positions: [hq, r] query
    positions per head (None: all), the same in each of the first `batch_used` batch elements.
    Scores are q·kᵀ/√d in the inputs' dtype (as the attention kernel computes them), softmax in
    float32; query i sees keys j <= i + (sk − sq) (the causal mask, aligned at the end).
    """
    qb, kb = to_bhsd(q.detach(), order), to_bhsd(k.detach(), order)
    b, hq, sq, d = qb.shape
    bk, hkv, sk, dk = kb.shape
    if b != bk or d != dk or hkv == 0 or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not fit {order} attention")
    used = b if batch_used is None else min(b, batch_used)
    qb, kb = qb[:used], kb[:used]
    if positions is None:
        positions = torch.arange(sq, device=q.device).expand(hq, sq)
        rows = qb
    else:
        heads = torch.arange(hq, device=q.device).unsqueeze(1)
        rows = qb[:, heads, positions]  # [used, hq, r, d]
    r = positions.shape[1]
    group = hq // hkv
    rows = rows.reshape(used, hkv, group * r, d)  # query heads of one key head side by side
    scores = torch.matmul(rows.to(kb.dtype), kb.transpose(-1, -2)).float() * (1.0 / math.sqrt(d))
    limit = (positions + (sk - sq)).reshape(1, hkv, group * r, 1)
    hidden = torch.arange(sk, device=q.device).view(1, 1, 1, sk) > limit
    p = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    entropy = torch.special.entr(p).sum(dim=-1)
    return entropy.mean(), p.amax(dim=-1).mean()


def expert_axis(shape: torch.Size, experts: int | None) -> int:
    """Which axis of a 2-D router weight indexes the experts: the one of length `experts`
    (the router output's last dimension) when exactly one has it, else the shorter one
    (nn.Linear(hidden, E).weight is [E, hidden]; Megatron's router weight too)."""
    if experts is not None and (shape[0] == experts) != (shape[1] == experts):
        return 0 if shape[0] == experts else 1
    return 0 if shape[0] <= shape[1] else 1


def router_weight_similarity(w: torch.Tensor, axis: int) -> torch.Tensor:
    """Mean cosine similarity over all pairs i < j of expert vectors (rows of W if axis is 0).

    With n_i the unit expert vectors (a zero vector stays zero, as F.normalize leaves it) and
    s = Σ n_i: Σ_{i≠j} n_i·n_j = ‖s‖² − Σ‖n_i‖², so the mean over E(E−1)/2 pairs needs no E×E
    matrix. NaN with fewer than two experts."""
    x = w.detach().movedim(axis, 0).to(_vector_dtype(w))
    experts = x.shape[0]
    n = x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(1e-12)
    s = n.sum(dim=0, dtype=torch.float64)
    off_diagonal = s.dot(s) - (n.double() * n.double()).sum()
    pairs = experts * (experts - 1)
    return off_diagonal / pairs if pairs else torch.full((), float("nan"), dtype=torch.float64, device=w.device)


def router_logit_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens (every leading index) of −Σ_e p_e log p_e, p = softmax over the last
    axis (experts) in float32. Masked experts (−inf logits, p = 0) add 0; a NaN logit gives NaN."""
    x = logits.detach().float()
    x = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    return torch.special.entr(torch.softmax(x, dim=-1)).sum(dim=-1).mean()

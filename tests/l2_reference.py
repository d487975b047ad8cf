"""The L2 features computed directly, in float64, by loops and explicit matrices: what the
tests compare msmon's values with."""

from __future__ import annotations

import math

import torch


def to_bhsd(x: torch.Tensor, order: str) -> torch.Tensor:
    return {
        "s,b,h,d": lambda t: t.permute(1, 2, 0, 3),
        "b,s,h,d": lambda t: t.permute(0, 2, 1, 3),
        "b,h,s,d": lambda t: t,
    }[order](x)


def attention(q: torch.Tensor, k: torch.Tensor, rows=None, batches=None) -> tuple[float, float]:
    """Mean entropy and mean max of the causal softmax(q kᵀ/√d) rows of every batch element
    and head; q [b, hq, sq, d], k [b, hkv, sk, d]; rows: [hq, r] query positions per head."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    entropies, maxima = [], []
    for bi in range(b if batches is None else batches):
        for h in range(hq):
            scores = q[bi, h].double() @ k[bi, h // (hq // hkv)].double().T / math.sqrt(d)
            for i in range(sq) if rows is None else rows[h].tolist():
                p = torch.softmax(scores[i, : i + (sk - sq) + 1], dim=0)
                entropies.append(float(-(p * p.log()).sum()))
                maxima.append(float(p.max()))
    return sum(entropies) / len(entropies), sum(maxima) / len(maxima)


def mean_cosine(experts: torch.Tensor) -> float:
    """Mean over pairs i < j of the cosine matrix of expert vectors (rows); a zero row gives 0."""
    e = experts.double()
    n = e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)
    cos = n @ n.T
    i, j = torch.triu_indices(len(e), len(e), offset=1)
    return float(cos[i, j].mean())


def logit_entropy(logits: torch.Tensor) -> float:
    p = torch.softmax(logits.double().reshape(-1, logits.shape[-1]), dim=-1)
    return float(torch.where(p > 0, -p * p.log(), torch.zeros_like(p)).sum(-1).mean())


def spectral(w: torch.Tensor) -> tuple[float, float]:
    """(‖W‖₂ from the singular values, stable rank ‖W‖²_F/‖W‖²₂)."""
    s = torch.linalg.svdvals(w.double())
    return float(s[0]), float((s**2).sum() / s[0] ** 2)

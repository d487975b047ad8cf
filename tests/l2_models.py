"""Plain-torch models with the modules the L2 feature hooks look at: an attention core that
receives q and k (in a chosen layout, with grouped key heads), and a top-2 mixture of experts
whose router is an nn.Linear giving logits."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def to_bhsd(x: torch.Tensor, order: str) -> torch.Tensor:
    return {
        "s,b,h,d": lambda t: t.permute(1, 2, 0, 3),
        "b,s,h,d": lambda t: t.permute(0, 2, 1, 3),
        "b,h,s,d": lambda t: t,
    }[order](x)


class CoreAttention(nn.Module):
    """Causal softmax(q·kᵀ/√d)·v; forward(q, k, v) as Megatron's core attention takes them."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qb, kb, vb = (to_bhsd(t, self.order) for t in (q, k, v))
        group = qb.shape[1] // kb.shape[1]
        kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)  # [b, h, s, d]
        return out.transpose(1, 2).flatten(2)  # [b, s, h*d]


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, kv_heads: int, order: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.order = heads, kv_heads, d_model // heads, order
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * kv_heads * self.head_dim)
        self.core = CoreAttention(order)
        self.o_proj = nn.Linear(d_model, d_model)

    def _layout(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, s, _ = x.shape
        x = x.view(b, s, heads, self.head_dim)  # b,s,h,d
        return {"s,b,h,d": x.transpose(0, 1), "b,s,h,d": x, "b,h,s,d": x.transpose(1, 2)}[self.order]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        q = self._layout(self.q_proj(x), self.heads)
        k, v = self._layout(k, self.kv_heads), self._layout(v, self.kv_heads)
        return self.o_proj(self.core(q, k, v))


class AttentionLM(nn.Module):
    """Embedding, `layers` pre-norm attention blocks, a head."""

    def __init__(
        self,
        vocab: int = 40,
        d_model: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        layers: int = 2,
        order: str = "s,b,h,d",
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.layers = nn.ModuleList(Attention(d_model, heads, kv_heads, order) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return self.head(x)


class MoE(nn.Module):
    """Top-2 routing over `experts` feed-forward experts; `router` gives the logits."""

    def __init__(self, d_model: int = 16, experts: int = 6) -> None:
        super().__init__()
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        gates = torch.softmax(self.router(tokens), dim=-1)
        weight, chosen = gates.topk(2, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            picked = (chosen == e).any(dim=-1)
            share = (weight * (chosen == e)).sum(dim=-1, keepdim=True)
            out = out + picked.unsqueeze(-1) * share * expert(tokens)
        return (tokens + out).view_as(x)


class MoEModel(nn.Module):
    def __init__(self, d_in: int = 8, d_model: int = 16, experts: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d_model)
        self.moe = MoE(d_model, experts)
        self.out = nn.Linear(d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x)))

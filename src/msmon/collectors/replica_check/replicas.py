"""Which tensors are replicas: the replicated weights and reduced gradients of the
optimizer's parameters, and each one left out with why (see the package's collector.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...runtime import dedupe
from ...seams.adapters import Shard
from .entries import GRAD, WEIGHT, Entry, SkippedTensor, ranks_text

if TYPE_CHECKING:
    from ...runtime.step_context import StepContext


def named_params(ctx: StepContext) -> list[tuple[str, int, torch.Tensor]]:
    """(display name, model chunk, parameter) of every parameter the optimizer trains, in its order."""
    _, params = ctx.names()
    where: dict[int, tuple[str, int]] = {}
    for chunk, named in enumerate(params):
        for name, p in named.items():
            where.setdefault(id(p), (name, chunk))
    out = []
    for i, p in enumerate(ctx.adapter.params()):
        name, chunk = where.get(id(p), (f"param[{i}]", 0))
        out.append((name, chunk, p))
    return out


Named = list[tuple[str, int, torch.Tensor]]


class DeclaredCopies:
    """The ranks the adapter declares hold copies of this rank's piece of a parameter (its
    `replica_group`: HSDP's replicate group), looked up once per group; `group_ranks` are the
    ranks of the check's group (None: not known yet, anything goes)."""

    def __init__(self, adapter: Any, group_ranks: list[int] | None) -> None:
        self.adapter = adapter
        self.group_ranks = sorted(group_ranks) if group_ranks is not None else None
        self._ranks: dict[int, list[int]] = {}

    def of(self, param: torch.Tensor) -> list[int] | None:
        group = self.adapter.replica_group(param)
        if group is None:
            return None
        found = self._ranks.get(id(group))
        if found is None:
            found = self._ranks[id(group)] = sorted(dist.get_process_group_ranks(group))
        return found

    def elsewhere(self, ranks: list[int]) -> str | None:
        """Why copies across `ranks` cannot be compared in this check (None: they can)."""
        if self.group_ranks is None or ranks == self.group_ranks:
            return None
        return (
            f"its copies lie across {ranks_text(ranks)}, not the check's group ({ranks_text(self.group_ranks)}): "
            "one group per check"
        )


def _declared(
    copies: DeclaredCopies, p: torch.Tensor, value: Any
) -> tuple[str | None, bool, torch.Tensor | None] | None:
    """What the adapter declares of `p`: (why skipped, whether a shard, the tensor to fingerprint),
    or None when it declares nothing (the other rules apply)."""
    held = copies.of(p)
    if held is not None:
        why = copies.elsewhere(held)
        if isinstance(value, Shard):
            return why, True, value.local
        return why, False, value
    why = copies.adapter.unreplicated(p)
    return (why, False, None) if why is not None else None


def select_weights(
    ctx: StepContext, named: Named | None = None, group_ranks: list[int] | None = None
) -> tuple[list[Entry], list[torch.Tensor], list[SkippedTensor]]:
    """The replicated weights (model parameters, whole main copies, the pieces the adapter
    declares copied across the check's group `group_ranks`), and what was skipped and why."""
    named = named_params(ctx) if named is None else named
    not_a_replica = dedupe.replica_exclusion(ctx.models, ctx.adapter.optimizer, weights=True, frameworks=ctx.frameworks)
    mains = ctx.adapter.own_weights([p for _, _, p in named])
    copies = DeclaredCopies(ctx.adapter, group_ranks)
    entries: list[Entry] = []
    tensors: list[torch.Tensor] = []
    skipped: list[SkippedTensor] = []
    for name, chunk, p in named:
        main = mains.get(id(p))
        declared = _declared(copies, p, p if main is None else main)
        if declared is not None:
            why, shard, tensor = declared
            if why is not None or tensor is None:
                skipped.append({"name": name, "vpp_stage": chunk, "category": WEIGHT, "why": why or "no weight"})
            else:
                entries.append(Entry(name, chunk, WEIGHT, shard))
                tensors.append(tensor)
            continue
        why = not_a_replica(p)
        if why is None:
            entries.append(Entry(name, chunk, WEIGHT))
            tensors.append(p)
        else:
            skipped.append({"name": name, "vpp_stage": chunk, "category": WEIGHT, "why": why})
        if main is None or main is p:
            continue
        label = f"{name}[main]"
        if isinstance(main, Shard) or callable(getattr(main, "to_local", None)):
            skipped.append(
                {
                    "name": label,
                    "vpp_stage": chunk,
                    "category": WEIGHT,
                    "why": "this rank's piece of the fp32 main copy, split across the data-parallel ranks",
                }
            )
        else:
            entries.append(Entry(label, chunk, WEIGHT))
            tensors.append(main)
    return entries, tensors, skipped


def select_grads(
    ctx: StepContext, named: Named | None = None, group_ranks: list[int] | None = None
) -> tuple[list[Entry], list[torch.Tensor | None], list[SkippedTensor]]:
    """The reduced gradients that are whole on every rank, and the pieces the adapter declares
    copied across the check's group (None: no gradient on this rank)."""
    named = named_params(ctx) if named is None else named
    grads = ctx.adapter.own_grads([p for _, _, p in named], ctx.grad_of)
    not_a_replica = dedupe.replica_exclusion(
        ctx.models, ctx.adapter.optimizer, weights=False, frameworks=ctx.frameworks
    )
    copies = DeclaredCopies(ctx.adapter, group_ranks)
    entries: list[Entry] = []
    tensors: list[torch.Tensor | None] = []
    skipped: list[SkippedTensor] = []
    for name, chunk, p in named:
        g = grads.get(id(p))
        declared = _declared(copies, p, g)
        if declared is not None:
            why, shard, tensor = declared
            if why is not None:
                skipped.append({"name": name, "vpp_stage": chunk, "category": GRAD, "why": why})
            else:
                entries.append(Entry(name, chunk, GRAD, shard))
                tensors.append(tensor)
            continue
        why = not_a_replica(p)
        if why is None and isinstance(g, Shard):
            why = "this rank's piece of the reduced gradient, split across the data-parallel ranks"
        if why is None and g is not None and callable(getattr(g, "to_local", None)):
            why = "a DTensor (FSDP2): each rank holds its own shard"
        if why is not None:
            skipped.append({"name": name, "vpp_stage": chunk, "category": GRAD, "why": why})
            continue
        entries.append(Entry(name, chunk, GRAD))
        tensors.append(g)
    return entries, tensors, skipped

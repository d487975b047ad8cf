"""Exact statistics of tensors split across ranks (ZeRO partitions, distributed-optimizer shards).

During the step each rank computes the statistics of its own piece of every split tensor
(`take`), on its device, and the writing rank reserves a placeholder row in the step buffer,
so rows keep their order. When the step ends (`flush`), one all_gather per process group brings
every rank's piece rows together (a few numbers per tensor, never the tensors), they are
combined exactly (min of mins, max of maxes, square root of summed squares, count-weighted
mean and zero fraction, summed nan/inf counts and histograms) and copied into the
placeholders before the buffer goes to the host.

Every rank of a group must take the same Shards in the same order and flush at the same step:
they do, since the adapters yield a (possibly empty) piece for every parameter on every rank
and the recorded steps follow from the config, which the ranks switch at the same step
(agreement.py: the payload's first number is this rank's in that agreement).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from ..records.rows import RowKey, row_key
from ..seams.adapters import Shard
from ..stats.combine import combine_gathered
from ..stats.engine import batch_stats
from ..stats.scalar import scalar_rows
from ..system import exit_drain
from .buffer import Histogram

if TYPE_CHECKING:
    from .step_context import StepContext

logger = logging.getLogger("msmon")


@dataclass
class _Pending:
    """One group's pieces of this step."""

    group: Any
    rows: list[torch.Tensor] = field(default_factory=list)  # [n, ops] per take
    counts: list[int] = field(default_factory=list)
    targets: list[tuple[torch.Tensor, list[int]]] = field(default_factory=list)  # (placeholder, slot per row)
    hists: list[torch.Tensor] = field(default_factory=list)
    hist_targets: list[Optional[torch.Tensor]] = field(default_factory=list)  # placeholder counts (None: not written)
    size: int = 0
    # shares (mg_direction): per-piece counts of matching elements and piece sizes, summed over ranks
    matches: list[torch.Tensor] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    share_targets: list[tuple[torch.Tensor, list[int]]] = field(default_factory=list)
    eps: float = 1e-8


class ShardCombiner:
    """Statistics of one monitor's Shards: pieces during the step, combined at its end. Reads
    the step's parameters, statistics and buffer from the monitor's step context."""

    def __init__(self, ctx: StepContext, enabled: bool = True) -> None:
        self.ctx = ctx
        self.enabled = enabled
        self.pending: dict[int, _Pending] = {}
        self.ops: list[str] = []
        # the number each gather carries in front of the statistics (agreement.py), and what
        # every rank sent, by id(group), from the last flush
        self.stamp: Callable[[], float] | None = None
        self.stamped: dict[int, torch.Tensor] = {}

    def take(self, category: str, values: dict[int, Any]) -> dict[int, Any]:
        """Record the Shards among `values` (keyed by id(param), in the monitor's parameter
        order) under `category`; return the other values for the caller to record itself."""
        plain = {k: v for k, v in values.items() if not isinstance(v, Shard)}
        if len(plain) == len(values):
            return values
        if not self.enabled:
            return plain
        ctx = self.ctx
        by_group: dict[int, list[tuple[RowKey, Shard]]] = {}
        for mp in ctx.params:
            value = values.get(id(mp.param))
            if isinstance(value, Shard):
                by_group.setdefault(id(value.group), []).append((row_key(category, mp.name, mp.vpp_stage), value))
        for entries in by_group.values():
            self._add(ctx.buffer, entries, ctx.step_ops, ctx.config.eps)
        return plain

    def _add(self, buffer: Any, entries: list[tuple[RowKey, Shard]], ops: list[str], eps: float) -> None:
        shards = [s for _, s in entries]
        pending = self.pending.get(id(shards[0].group))
        if pending is None:
            pending = self.pending[id(shards[0].group)] = _Pending(shards[0].group)
        self.ops = list(ops)
        rows = batch_stats([s.local for s in shards], ops, eps)
        first = pending.size
        pending.rows.append(rows)
        pending.counts.extend(s.local.numel() for s in shards)
        pending.size += len(shards)
        written = [i for i, s in enumerate(shards) if s.write]
        if written:
            placeholder = torch.full((len(written), len(ops)), math.nan, dtype=rows.dtype, device=rows.device)
            buffer.add_many([entries[i][0] for i in written], placeholder)
            pending.targets.append((placeholder, [first + i for i in written]))

    def add_shares(self, keys: list[RowKey], shards: list[Shard], matches: torch.Tensor, numels: list[int]) -> None:
        """Pieces of a share (mg_direction: elements where two sharded tensors agree) of one group:
        `matches` [n] counts on this rank's pieces of `numels` elements. The ranks' counts are
        summed at the end of the step and share = matches / elements, as exact as computing it
        on the whole tensors; rows the writing rank reserved now are filled then."""
        if not self.enabled or not shards:
            return
        ctx = self.ctx
        pending = self.pending.get(id(shards[0].group))
        if pending is None:
            pending = self.pending[id(shards[0].group)] = _Pending(shards[0].group)
        self.ops = list(ctx.step_ops)
        pending.eps = ctx.config.eps
        first = len(pending.numels)
        pending.matches.append(matches.to(torch.float64))
        pending.numels.extend(numels)
        written = [i for i, s in enumerate(shards) if s.write]
        if written:
            placeholder = torch.full(
                (len(written), len(self.ops)), math.nan, dtype=torch.float64, device=matches.device
            )
            ctx.buffer.add_many([keys[i] for i in written], placeholder)
            pending.share_targets.append((placeholder, [first + i for i in written]))

    def add_histogram(self, tag: str, edges: list[float], counts: torch.Tensor, shard: Shard) -> None:
        """A histogram of a Shard's piece; the ranks' counts are summed at the end of the step."""
        if not self.enabled:
            return
        pending = self.pending.get(id(shard.group))
        if pending is None:
            pending = self.pending[id(shard.group)] = _Pending(shard.group)
        counts = counts.to(torch.float64)
        pending.hists.append(counts)
        target = None
        if shard.write:
            target = torch.zeros_like(counts)
            self.ctx.buffer.histograms.append(Histogram(tag, edges, target))
        pending.hist_targets.append(target)

    def flush(self) -> None:
        """Combine this step's pieces across ranks and fill the placeholders (one all_gather
        per group). A failure switches combining off: the placeholders stay NaN."""
        pending, self.pending = self.pending, {}
        for part in pending.values():
            try:
                self._combine(part)
            except Exception as exc:  # contained: training goes on, sharded statistics stop
                self.enabled = False
                logger.error(
                    "msmon[rank %d]: combining sharded statistics failed and is switched off; training continues: %r",
                    self.ctx.rank,
                    exc,
                )
                return

    def take_stamped(self) -> dict[int, torch.Tensor]:
        """Every rank's number from this step's gathers, by id(group); cleared for the next."""
        stamped, self.stamped = self.stamped, {}
        return stamped

    def _combine(self, part: _Pending) -> None:
        n_ops = len(self.ops)
        device = part.rows[0].device if part.rows else part.hists[0].device if part.hists else part.matches[0].device
        rows = (
            torch.cat(part.rows).to(device)
            if part.rows
            else torch.empty((0, n_ops), dtype=torch.float64, device=device)
        )
        counts = torch.tensor(part.counts, dtype=torch.float64).to(device, non_blocking=True)
        hists = (
            torch.stack(part.hists).to(device)
            if part.hists
            else torch.empty((0, 0), dtype=torch.float64, device=device)
        )
        matches = (
            torch.cat(part.matches).to(device) if part.matches else torch.empty(0, dtype=torch.float64, device=device)
        )
        numels = torch.tensor(part.numels, dtype=torch.float64).to(device, non_blocking=True)
        lead = [] if self.stamp is None else [torch.full((1,), self.stamp(), dtype=torch.float64, device=device)]
        payload = torch.cat([*lead, rows.reshape(-1), counts, hists.reshape(-1), matches, numels])
        gathered = _all_gather(payload, part.group)  # [ranks, payload]
        if lead:
            self.stamped[id(part.group)] = gathered[:, 0]
            gathered = gathered[:, 1:]
        if part.matches:
            k = len(part.numels)
            width = gathered.shape[1]
            summed = gathered[:, width - 2 * k :].sum(0)
            shares = scalar_rows(summed[:k] / summed[k:], self.ops, part.eps)  # 0 / 0: NaN, a tensor empty everywhere
            for placeholder, slots in part.share_targets:
                index = torch.tensor(slots, dtype=torch.long).to(shares.device, non_blocking=True)
                placeholder.copy_(shares.index_select(0, index).to(placeholder.device))
            gathered = gathered[:, : width - 2 * k]
        n = rows.shape[0]
        all_rows = gathered[:, : n * n_ops].reshape(-1, n, n_ops)
        all_counts = gathered[:, n * n_ops : n * n_ops + n]
        combined = combine_gathered(all_rows, all_counts, self.ops)
        for placeholder, slots in part.targets:
            index = torch.tensor(slots, dtype=torch.long).to(combined.device, non_blocking=True)
            placeholder.copy_(combined.index_select(0, index).to(placeholder.device))
        if part.hists:
            summed = gathered[:, n * n_ops + n :].reshape(gathered.shape[0], *hists.shape).sum(0)
            for i, target in enumerate(part.hist_targets):
                if target is not None:
                    target.copy_(summed[i].to(target.device))


def _all_gather(payload: torch.Tensor, group: Any) -> torch.Tensor:
    """[ranks, len(payload)]: every rank's payload, in group-rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return payload.unsqueeze(0)
    world = dist.get_world_size(group)
    if world == 1:
        return payload.unsqueeze(0)
    if "nccl" in str(dist.get_backend(group)) and payload.device.type == "cpu":
        payload = payload.to(torch.device("cuda", torch.cuda.current_device()))
    out = [torch.empty_like(payload) for _ in range(world)]
    exit_drain.hold(dist.all_gather(out, payload, group=group, async_op=True)).wait()  # held: exit_drain.py
    return torch.stack(out)

"""Adam moments (`exp_avg`, `exp_avg_sq`) and the update/ratio they imply.

update = m_hat / (sqrt(v_hat) + eps) and ratio = m_hat / sqrt(v_hat), with the bias
corrections m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t), computed for all parameters
with multi-tensor ops (collectors/adam_update.py). With ur_distribution the
per-parameter histograms of both go to TensorBoard (and, with heatmap_visualize, heatmap images drawn
from them on the writer thread: output/sinks/heatmap.py). An optimizer that keeps
no such moments (LBFGS, SGD with or without momentum, Adagrad...) has nothing to record: that is
said once per rank, naming its class.

mg_direction: before the update, the share of elements whose gradient (the one the step
consumes) has the sign of the momentum accumulated so far (exp_avg), sign(g) == sign(m), zero
equal to zero; NaN when either holds a NaN. Rows go where msprobe puts them (`other_*.csv`, tag
`.../mg_direction_{op}`, the ops applied to the share). The first step has no momentum yet and
writes no row (msprobe writes 1.0 there). A sparse gradient (SparseAdam's) is left out of it,
said once. Counts are taken on the device in one batch; for a
tensor split across ranks each rank counts its piece and the counts are summed at the end of
the step (optimizers/shards.py), so the share is exactly that of the whole tensors.
"""

from __future__ import annotations

import logging

import torch

from ..records.rows import OPTIMIZER, DirectionKey, RowKey, format_tag, row_key
from ..runtime.buffer import Histogram
from ..runtime.step_context import StepContext
from ..seams.adapters import Shard
from ..stats.engine import batch_stats
from ..stats.inputs import _to_device, local_tensor
from ..stats.scalar import scalar_rows
from ..stats.signs import sign_matches
from .adam_update import updates_and_ratios
from .base import Collector
from .registry import register

logger = logging.getLogger("msmon")

HIST_EDGES = [-1.0 + i / 16 for i in range(33)]  # 32 buckets over [-1, 1]; outliers clamp to the ends


@register(
    key="optimizer_state",
    category="optimizer",
    order=100,
    enabled=lambda cfg, ctx: cfg.mv_distribution or cfg.ur_distribution or cfg.mg_direction,
)
class OptimizerStateCollector(Collector):
    name = "optimizer state"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        self._said_none = False
        self._said_sparse = False
        self._size_cache: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def before_update(self) -> None:
        ctx = self.ctx
        if not (ctx.recording and ctx.config.mg_direction):
            return
        params = [mp.param for mp in ctx.params]
        grads = ctx.adapter.grads(params, ctx.grad_of)
        moments = ctx.adapter.moments(params)
        plain: list[tuple[RowKey, torch.Tensor, torch.Tensor]] = []
        split: dict[int, list[tuple[RowKey, Shard, Shard]]] = {}
        for mp in ctx.params:
            grad, m = grads.get(id(mp.param)), moments.get(id(mp.param))
            if grad is None or m is None:
                continue
            if not isinstance(grad, Shard) and grad.layout is not torch.strided:  # sparse (stats.sparse.is_sparse)
                self._skip_sparse(mp.name)
                continue
            key = DirectionKey(DirectionKey.CATEGORY, mp.name, mp.vpp_stage, stage=OPTIMIZER)
            if isinstance(grad, Shard) and isinstance(m.exp_avg, Shard):
                split.setdefault(id(grad.group), []).append((key, grad, m.exp_avg))
            elif not isinstance(grad, Shard) and not isinstance(m.exp_avg, Shard):
                plain.append((key, grad, m.exp_avg))
        if plain:
            matches = sign_matches([g for _, g, _ in plain], [e for _, _, e in plain])
            shares = matches / self._sizes(tuple(local_tensor(g).numel() for _, g, _ in plain), matches.device)
            ctx.buffer.add_many([k for k, _, _ in plain], scalar_rows(shares, ctx.step_ops, ctx.config.eps))
        for entries in split.values():  # every rank of the group takes the same pieces in the same order
            matches = sign_matches([g.local for _, g, _ in entries], [e.local for _, _, e in entries])
            ctx.shards.add_shares(
                [k for k, _, _ in entries],
                [g for _, g, _ in entries],
                matches,
                [g.local.numel() for _, g, _ in entries],
            )

    def _skip_sparse(self, name: str) -> None:
        if not self._said_sparse:
            self._said_sparse = True
            logger.warning(
                "msmon[rank %d]: the gradient of %s is sparse; mg_direction leaves such parameters out "
                "(their gradient and Adam-moment rows are still recorded; said once)",
                self.ctx.rank,
                name,
            )

    def _sizes(self, numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The element counts as a float64 tensor on the device, built once (the same every step)."""
        key = (numels, device)
        if key not in self._size_cache:
            if len(self._size_cache) > 8:
                self._size_cache.clear()
            self._size_cache[key] = _to_device(torch.tensor(numels, dtype=torch.float64), device)
        return self._size_cache[key]

    def after_update(self) -> None:
        ctx = self.ctx
        if not ctx.recording:
            return
        cfg = ctx.config
        params = [mp.param for mp in ctx.params]
        moments = ctx.adapter.moments(params)
        present = [(i, mp, moments[id(mp.param)]) for i, mp in enumerate(ctx.params) if id(mp.param) in moments]
        if not present:
            if params and not self._said_none and not ctx.adapter.holds_moments(params):
                self._said_none = True
                asked = " and ".join(
                    k for k in ("mv_distribution", "ur_distribution", "mg_direction") if getattr(cfg, k)
                )
                logger.warning(
                    "msmon[rank %d]: %s keeps no Adam moments (exp_avg, exp_avg_sq); %s records nothing for it",
                    ctx.rank,
                    ctx.adapter.optimizer_name,
                    asked,
                )
            return
        if cfg.mv_distribution:
            for category, attr in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                self._add(category, {id(mp.param): getattr(m, attr) for _, mp, m in present})
        if cfg.ur_distribution:
            self._update_ratio(present)

    def _add(self, category: str, values: dict) -> None:
        """Rows of `values` (keyed by id(param)); Shards go to the monitor's combiner."""
        ctx = self.ctx
        values = ctx.shards.take(category, values)
        chosen = [mp for mp in ctx.params if id(mp.param) in values]
        if chosen:
            keys = [row_key(category, mp.name, mp.vpp_stage) for mp in chosen]
            rows = batch_stats([values[id(mp.param)] for mp in chosen], ctx.step_ops, ctx.config.eps)
            ctx.buffer.add_many(keys, rows)

    @torch.no_grad()
    def _update_ratio(self, present) -> None:
        ctx = self.ctx
        updates: dict[int, torch.Tensor | Shard] = {}  # id(param) -> its update (a Shard: a piece of it)
        ratios: dict[int, torch.Tensor | Shard] = {}
        shards = [m.exp_avg if isinstance(m.exp_avg, Shard) else None for _, _, m in present]
        exp_avgs = [(sh.local if sh else local_tensor(m.exp_avg)).float() for sh, (_, _, m) in zip(shards, present)]
        exp_avg_sqs = [
            (m.exp_avg_sq.local if sh else local_tensor(m.exp_avg_sq)).float() for sh, (_, _, m) in zip(shards, present)
        ]
        all_updates, all_ratios = updates_and_ratios(exp_avgs, exp_avg_sqs, [m for _, _, m in present])
        for (_, mp, _), shard, update, ratio in zip(present, shards, all_updates, all_ratios):
            for category, t, out in (("update", update, updates), ("ratio", ratio, ratios)):
                counts = torch.histc(t.clamp(-1.0, 1.0), bins=len(HIST_EDGES) - 1, min=-1.0, max=1.0)
                tag = format_tag(f"{mp.vpp_stage}:{mp.name}", ctx.rank, f"{category}_hist")
                if shard:  # a piece: its histogram is summed over the ranks holding the others
                    out[id(mp.param)] = Shard(t, shard.group, shard.write)
                    ctx.shards.add_histogram(tag, HIST_EDGES, counts, out[id(mp.param)])
                else:
                    out[id(mp.param)] = t
                    ctx.buffer.histograms.append(Histogram(tag, HIST_EDGES, counts))
        self._add("update", updates)
        self._add("ratio", ratios)

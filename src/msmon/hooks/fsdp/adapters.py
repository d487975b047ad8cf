"""Optimizer adapters for PyTorch's own sharding: FSDP2 (`fully_shard`) and FSDP1
(`FullyShardedDataParallel`, `use_orig_params` True or False).

Both train a plain torch.optim optimizer, so they are recognised from its parameters, not its
class. Every parameter is split across the ranks of its shard group: the adapters answer
with a `Shard` of this rank's piece of the weight, the reduced gradient and the Adam moments
(an empty piece where this rank holds none), and the ShardCombiner turns the pieces'
statistics into the whole tensor's (one all_gather of statistics per step, never of tensors).
Padding is never part of a piece: an FSDP2 DTensor's local tensor is its unpadded chunk, an
FSDP1 original parameter is a view of its own elements of the flat shard.

Rank-local gradients (`grad_unreduced`) are read where FSDP hands them to the reduce-scatter
(seams.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...runtime.naming import clean_name
from ...seams.adapters import GradPairs, Moments, Shard, TorchOptimAdapter, adam_hyper
from . import seams
from .groups import Placement, dtensor_placement, fsdp1_units, is_dtensor, unit_placement


class _ShardedTorchAdapter(TorchOptimAdapter):
    """A torch.optim optimizer over parameters split across ranks; `placement` per parameter."""

    hooks_unreduced = True

    def __init__(self, optimizer: Any, placement: dict[int, Placement], whole: dict[int, Any] | None = None) -> None:
        super().__init__(optimizer)
        self.placement = placement
        self.whole = whole or {}  # id(param) -> the group it is whole and copied across (FSDP1 NO_SHARD)
        self.steps_done = 0  # the same on every rank, unlike which parameters have state here

    def hook_step(self, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
        def counted() -> None:
            self.steps_done += 1
            after()

        return super().hook_step(before, counted)

    # -- groups ------------------------------------------------------------------------------------
    def shard_group(self, param: torch.Tensor) -> Any:
        found = self.placement.get(id(param))
        return found.shard if found is not None else None

    def replica_group(self, param: torch.Tensor) -> Any:
        """The group this rank's piece of `param` is copied across (HSDP's replicate dimension,
        FSDP1 HYBRID_SHARD's `_inter_node_pg`; a NO_SHARD unit's group for its whole
        parameters), or None."""
        found = self.placement.get(id(param))
        return found.replicate if found is not None else self.whole.get(id(param))

    def unreplicated(self, param: torch.Tensor) -> str | None:
        found = self.placement.get(id(param))
        if found is None or found.replicate is not None:
            return None
        return (
            f"this rank's shard: FSDP splits it across {_ranks(found.shard)} and no other rank holds a copy of "
            "this piece (no replicate dimension, as HSDP has)"
        )

    def shard_groups(self) -> list[Any]:
        return list({id(p.shard): p.shard for p in self.placement.values()}.values())

    def data_parallel_group(self) -> Any:
        groups = {id(p.replicate): p.replicate for p in self.placement.values() if p.replicate is not None}
        return next(iter(groups.values())) if len(groups) == 1 else None

    # -- pieces ------------------------------------------------------------------------------------
    def _local(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _empty(self, param: torch.Tensor) -> torch.Tensor:
        return self._local(param).detach().new_empty(0)

    def _piece(self, param: torch.Tensor, t: torch.Tensor | None) -> Any:
        found = self.placement.get(id(param))
        if found is None:
            return t
        return Shard(self._empty(param) if t is None else self._local(t).detach(), found.shard)

    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        with torch.no_grad():
            return {id(p): self._piece(p, p) for p in params}

    def _grads(
        self, params: list[torch.Tensor], grad_of: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> dict[int, Any]:
        # every rank yields a piece for every trained parameter (an empty one where its
        # gradient is None here), so the ranks' statistics line up in the combining gather
        out = {}
        for p in params:
            g = grad_of(p)
            if id(p) in self.placement and p.requires_grad:
                out[id(p)] = self._piece(p, g)
            elif g is not None:
                out[id(p)] = g
        return out

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        opt = self.optimizer
        state = getattr(opt, "state", {})
        if not self.steps_done and not state:
            return {}  # before the first step no rank has moments: nothing to line up
        any_step = next((s["step"] for s in state.values() if "step" in s), 1)
        wanted = {id(p) for p in params}
        out: dict[int, Moments] = {}
        for group in opt.param_groups:
            hyper = adam_hyper(group)
            if hyper is None:
                continue
            for p in group["params"]:
                if id(p) not in wanted:
                    continue
                s = state.get(p) or {}
                has = "exp_avg" in s and "exp_avg_sq" in s
                if id(p) in self.placement and p.requires_grad:
                    # a rank whose piece is empty may have no state for it: an empty piece then
                    m, v = (s["exp_avg"], s["exp_avg_sq"]) if has else (None, None)
                    out[id(p)] = Moments(self._piece(p, m), self._piece(p, v), s.get("step", any_step), *hyper)
                elif has:
                    out[id(p)] = Moments(s["exp_avg"], s["exp_avg_sq"], s.get("step", 1), *hyper)
        return out


class Fsdp2Adapter(_ShardedTorchAdapter):
    """`fully_shard` parameters: DTensors sharded on dim 0 of their mesh's shard dimension."""

    family = "fsdp2"

    def __init__(self, optimizer: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        placement = {}
        for p in params:
            found = dtensor_placement(p) if is_dtensor(p) else None
            if found is not None:
                placement[id(p)] = found
        super().__init__(optimizer, placement)

    def _local(self, t: Any) -> torch.Tensor:
        return t.to_local() if is_dtensor(t) else t

    def hook_unreduced(self, models: list[torch.nn.Module], record: Callable[[GradPairs], None]):
        return seams.on_fsdp2_reduce(set(self.placement), record)


class Fsdp1Adapter(_ShardedTorchAdapter):
    """FullyShardedDataParallel(use_orig_params=True): each original parameter is a 1-D view of
    its elements in this rank's shard of the unit's flat parameter (empty where it has none)."""

    family = "fsdp1"

    def __init__(self, optimizer: Any, units: list[Any]) -> None:
        self.units = units
        placement = {}
        whole = {}
        for unit in units:
            if not unit._handle.uses_sharded_strategy:  # NO_SHARD: whole replicas, nothing to combine
                whole.update({id(p): unit.process_group for p in unit._handle.flat_param._params or []})
                continue
            found = unit_placement(unit)
            for p in unit._handle.flat_param._params or []:
                placement[id(p)] = found
        super().__init__(optimizer, placement, whole)

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def hook_unreduced(self, models: list[torch.nn.Module], record: Callable[[GradPairs], None]):
        flats = []
        for unit in self.units:
            flat = unit._handle.flat_param
            flats.append((flat, [p if id(p) in self.placement else None for p in flat._params or []]))
        return seams.on_fsdp1_reduce(flats, record)


class _Original:
    """Where one original parameter lies in its unit's flat parameter (use_orig_params=False)."""

    def __init__(self, flat: Any, index: int, fqn: str) -> None:
        self.flat = flat
        self.info = flat._shard_param_infos[index]
        self.fqn = fqn
        # the key it is monitored under: the original tensor no longer exists between steps
        self.key = torch.empty(0, device=flat.device)

    def piece(self, flat_tensor: torch.Tensor | None) -> torch.Tensor:
        """Its elements in this rank's shard of `flat_tensor` (the flat weight, gradient or a moment)."""
        if flat_tensor is None or not self.info.in_shard:
            return self.key.new_empty(0)
        return flat_tensor.detach().reshape(-1).narrow(0, self.info.offset_in_shard, self.info.numel_in_shard)


class Fsdp1FlatAdapter(_ShardedTorchAdapter):
    """FullyShardedDataParallel(use_orig_params=False): the optimizer trains each unit's
    FlatParameter; every original parameter is reported under its own name, as its elements
    of the flat shard (the flat parameter's `_shard_param_infos`; padding is no element)."""

    family = "fsdp1"

    def __init__(self, optimizer: Any, units: list[Any]) -> None:
        self.units = units
        self.originals: dict[int, list[_Original]] = {}  # id(flat parameter) -> its originals
        placement = {}
        whole = {}
        for unit in units:
            flat = unit._handle.flat_param
            if not unit._handle.uses_sharded_strategy:  # NO_SHARD: the flat parameter is a whole replica
                whole[id(flat)] = unit.process_group
                continue
            found = unit_placement(unit)
            originals = [_Original(flat, i, fqn) for i, fqn in enumerate(flat._fqns)]
            self.originals[id(flat)] = originals
            placement.update({id(o.key): found for o in originals})
        self.by_key = {id(o.key): o for originals in self.originals.values() for o in originals}
        super().__init__(optimizer, placement, whole)

    def params(self) -> list[torch.Tensor]:
        out = []
        for p in super().params():
            out.extend([o.key for o in self.originals[id(p)]] if id(p) in self.originals else [p])
        return out

    def named_params(self, chunks: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """The model's named parameters with each flat parameter replaced by its originals,
        named as the user's module names them (`fc1._flat_param` -> `fc1.weight`, `fc1.bias`)."""
        out = []
        for named in chunks:
            expanded: dict[str, torch.Tensor] = {}
            for name, p in named.items():
                if id(p) not in self.originals:
                    expanded[name] = p
                    continue
                prefix = name.rsplit("_flat_param", 1)[0]
                for o in self.originals[id(p)]:
                    expanded[clean_name(prefix + o.fqn)] = o.key
            out.append(expanded)
        return out

    def _weights(self, params: list[torch.Tensor]) -> dict[int, Any]:
        return self._by_flat(params, lambda o: o.flat)

    def _grads(self, params: list[torch.Tensor], grad_of: Callable) -> dict[int, Any]:
        return self._by_flat(params, lambda o: o.flat.grad)

    def _by_flat(self, params: list[torch.Tensor], source: Callable[[_Original], Any]) -> dict[int, Any]:
        out = {}
        for p in params:
            o = self.by_key.get(id(p))
            if o is not None:
                out[id(p)] = Shard(o.piece(source(o)), self.placement[id(p)].shard)
        return out

    def _moments(self, params: list[torch.Tensor]) -> dict[int, Moments]:
        opt = self.optimizer
        state = getattr(opt, "state", {})
        hyper_of = {id(p): adam_hyper(g) for g in opt.param_groups for p in g["params"]}
        out: dict[int, Moments] = {}
        for p in params:
            o = self.by_key.get(id(p))
            if o is None:
                continue
            s = state.get(o.flat)
            hyper = hyper_of.get(id(o.flat))
            if not s or hyper is None or "exp_avg" not in s or "exp_avg_sq" not in s:
                continue  # every rank holds a shard of every flat parameter: the same on all ranks
            group = self.placement[id(p)].shard
            out[id(p)] = Moments(
                Shard(o.piece(s["exp_avg"]), group), Shard(o.piece(s["exp_avg_sq"]), group), s.get("step", 1), *hyper
            )
        return out

    def hook_unreduced(self, models: list[torch.nn.Module], record: Callable[[GradPairs], None]):
        flats = [unit._handle.flat_param for unit in self.units]
        return seams.on_fsdp1_reduce(
            [(flat, [o.key for o in self.originals[id(flat)]]) for flat in flats if id(flat) in self.originals], record
        )


def _ranks(group: Any) -> str:
    import torch.distributed as dist

    try:
        return "ranks " + ", ".join(map(str, dist.get_process_group_ranks(group)))
    except Exception:  # not a member, or torch.distributed is gone
        return "its shard group"


def adapter_for(inner: Any) -> Any:
    """The FSDP adapter for a torch.optim optimizer whose parameters FSDP shards, else None."""
    params = [p for group in getattr(inner, "param_groups", None) or [] for p in group.get("params", [])]
    if not params or not isinstance(inner, torch.optim.Optimizer):
        return None
    if any(is_dtensor(p) and dtensor_placement(p) is not None for p in params):
        return Fsdp2Adapter(inner)
    if any(getattr(p, "_fsdp_flattened", False) for p in params):
        ids = {id(p) for p in params}
        units = fsdp1_units()
        originals = [u for u in units if any(id(q) in ids for q in u._handle.flat_param._params or [])]
        if originals:
            return Fsdp1Adapter(inner, originals)
        flats = [u for u in units if id(u._handle.flat_param) in ids]
        if flats:
            return Fsdp1FlatAdapter(inner, flats)
    return None

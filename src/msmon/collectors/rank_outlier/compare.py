"""One step's rank comparison on the exchange thread: the one gather of every rank's
statistics, the two tests (anomaly/rank_spread.py: the ranks' median and MAD, from three ranks;
anomaly/rank_history.py: each rank against its own history and the others', from two), and, only
when a rank departs, one gather of the departing statistic's per-tensor values to name the first
tensor where it departs.

Every rank reads the same gathered table and keeps the same histories, so all decide alike, and
the second gather, when there is one, is made by every rank of the group at the same point."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from ...anomaly.event import RANK_OUTLIER_RULE
from ...anomaly.rank_history import HistoryDeparture, RankHistory, TensorHistory
from ...anomaly.rank_spread import first_departing, spread
from ..replica_check.group import exchange
from .statistics import PER_TENSOR, STATISTICS, RankStatistics, Statistic

CALL_ID_LOSS = 1 << 29  # the loss has no row: after the forward rows of its step
OPS = {"actv": "actv_norm", "loss": "loss", "grad": "grad_norm"}
RANKS, OWN_HISTORY = "ranks", "own_history"  # what a departure was measured against


@dataclass
class Departure:
    """One rank's departure in one statistic."""

    stat: Statistic
    value: float
    score: float
    column: list[float]  # every rank's value, in group order
    reference: float  # the ranks' median (RANKS), or the rank's own recent value (OWN_HISTORY)
    scale: float  # the ranks' robust scale, or the history's scale of ln|value|
    basis: str = RANKS
    history: HistoryDeparture | None = None


@dataclass
class StepOutcome:
    """Who departs in one step, and the per-tensor values gathered to tell where."""

    departures: dict[int, list[Departure]]  # group position -> its departures, in training order
    tensors: dict[str, list[list[float]]]  # statistic key -> per tensor, its ranks' values


def compare_step(mine: RankStatistics, group: Any, ranks: list[int], k: float, history: RankHistory) -> StepOutcome:
    """This step's departures, every rank's alike. Raises when the ranks' steps do not line up."""
    payload = torch.tensor([mine.step, mine.layout] + [mine.values[s.key] for s in STATISTICS], dtype=torch.float64)
    table = exchange(payload, group, len(ranks))
    if bool((table[:, 0] != mine.step).any()):
        steps = dict(zip(ranks, table[:, 0].tolist()))
        raise RuntimeError(f"the ranks' steps do not line up: {steps}")
    found: dict[int, list[Departure]] = {}
    for j, stat in enumerate(STATISTICS):
        column = table[:, 2 + j].tolist()
        named: set[int] = set()
        ranks_spread = spread(column)  # None below three finite values
        if ranks_spread is not None:
            for position, value in enumerate(column):
                score = ranks_spread.score(value)
                if score > k:
                    named.add(position)
                    found.setdefault(position, []).append(
                        Departure(stat, value, score, column, ranks_spread.median, ranks_spread.scale)
                    )
        for d in history.step(stat.key, column, named):
            if d.position not in named:
                own = history.own[stat.key][d.position]
                departure = Departure(
                    stat, column[d.position], abs(d.score), column, d.recent, own.scale, OWN_HISTORY, d
                )
                found.setdefault(d.position, []).append(departure)
    tensors: dict[str, list[list[float]]] = {}
    if found and bool((table[:, 1] == table[0, 1]).all()):  # the same tensors on every rank
        firsts = {hits[0].stat.key for hits in found.values()}
        for stat in PER_TENSOR:
            if stat.key in firsts:
                values = torch.tensor(mine.tensors[stat.key].values, dtype=torch.float64)
                tensors[stat.key] = exchange(values, group, len(ranks)).t().tolist()
    return StepOutcome(found, tensors)


def enter_tensors(mine: RankStatistics, own: TensorHistory, named: list[Departure]) -> None:
    """This rank's tensors enter its own history, but a statistic it departs in (a lasting fault
    stays named at the tensor where it began)."""
    departed = {d.stat.key for d in named}
    for stat in PER_TENSOR:
        if stat.key not in departed:
            found = mine.tensors[stat.key]
            own.enter([(stat.key, name, vpp) for name, vpp, _ in found.names], found.values)


def _first_tensor(
    mine: RankStatistics,
    first: Departure,
    columns: dict[str, list[list[float]]],
    position: int,
    k: float,
    own: TensorHistory,
) -> tuple[int, float] | None:
    """(index, score) of the first tensor where the rank departs: against the other ranks' values
    of each tensor (the ranks' spread), or against its own history of each tensor."""
    key = first.stat.key
    if first.basis == RANKS:
        per_tensor = columns.get(key)
        return first_departing(per_tensor, position, k) if per_tensor is not None else None
    found = mine.tensors.get(key)
    if found is None or first.history is None:
        return None
    names = [(key, name, vpp) for name, vpp, _ in found.names]
    return own.first_departing(names, found.values, upward=first.history.score > 0)


def dump_record(
    mine: RankStatistics,
    hits: list[Departure],
    columns: dict[str, list[list[float]]],
    position: int,
    ranks: list[int],
    k: float,
    own: TensorHistory,
) -> dict[str, Any]:
    """The anomaly-dump record naming this rank (anomaly/event.py's fields, and the comparison)."""
    first = hits[0]
    stat = first.stat
    rank = ranks[position]
    name, vpp, call_id, tensor_text = stat.key, 0, CALL_ID_LOSS, ""
    tensor: dict[str, Any] | None = None
    where = _first_tensor(mine, first, columns, position, k, own) if stat.key != "loss" else None
    if where is not None:
        index, score = where
        name, vpp, call_id = mine.tensors[stat.key].names[index]
        value = mine.tensors[stat.key].values[index]
        per_tensor = columns.get(stat.key)
        others = [v for j, v in enumerate(per_tensor[index]) if j != position] if per_tensor is not None else []
        median = statistics.median(v for v in (per_tensor[index] if per_tensor else [value]) if math.isfinite(v))
        tensor = {"name": name, "value": value, "median": median, "score": score, "basis": first.basis}
        if first.basis == RANKS:
            tensor_text = f"; first departing tensor: {name} (norm {value:.6g}, the ranks' median {median:.6g})"
        else:
            recent = math.exp(own.tensors[(stat.key, name, vpp)].mean)
            tensor["recent"] = recent
            shown = statistics.median(others) if others else None
            tensor["others"] = shown
            theirs = "the other rank's" if len(ranks) == 2 else "the other ranks' median"
            tensor_text = f"; first departing tensor: {name} (norm {value:.6g}, its own recent {recent:.6g}" + (
                f", {theirs} {shown:.6g})" if shown is not None else ")"
            )
    elif stat.key != "loss":
        name, call_id = f"all {stat.category} tensors", 0
    also = "".join(f"; its {h.stat.said} departs too ({h.score:.3g} deviations)" for h in hits[1:])
    values = ", ".join(f"{v:.4g}" for v in first.column)
    if first.basis == RANKS:
        message = (
            f"rank {rank}'s {stat.said} {first.value:.6g} is {first.score:.3g} robust deviations from the ranks' "
            f"median {first.reference:.6g} (threshold {k:g}; ranks {ranks}: {values}){tensor_text}{also}"
        )
    else:
        d = first.history
        assert d is not None
        who, theirs = (
            ("the other rank", "the other rank's value")
            if len(ranks) == 2
            else ("the others", "the other ranks' median")
        )
        message = (
            f"rank {rank}'s {stat.said} {first.value:.6g} is {first.value / d.recent:.3g} times its own recent "
            f"{d.recent:.6g} ({first.score:.3g} deviations of its history) while {who} did not move with it: its "
            f"ratio to {theirs} went from {d.usual_ratio:.3g} to {d.ratio:.3g} ({abs(d.relative_score):.3g} "
            f"deviations; threshold {k:g}; ranks {ranks}: {values}){tensor_text}{also}"
        )
    record: dict[str, Any] = {
        "step": mine.step,
        "micro_step": None,
        "vpp_stage": vpp,
        "stage": stat.stage,
        "call_id": call_id,
        "name": name,
        "category": stat.category,
        "op": OPS[stat.key],
        "value": first.value,
        "history": first.reference,
        "rule": RANK_OUTLIER_RULE,
        "message": message,
        "statistic": stat.words,
        "basis": first.basis,
        "score": first.score,
        "scale": first.scale,
        "threshold": k,
        "group_ranks": ranks,
        "rank_values": {str(r): v for r, v in zip(ranks, first.column)},
        "tensor": tensor,
        "also": [
            {
                "statistic": h.stat.words,
                "value": h.value,
                ("median" if h.basis == RANKS else "recent"): h.reference,
                "score": h.score,
                "basis": h.basis,
            }
            for h in hits[1:]
        ],
    }
    if first.history is not None:
        d = first.history
        record.update(relative_score=abs(d.relative_score), ratio=d.ratio, usual_ratio=d.usual_ratio, others=d.others)
    return record

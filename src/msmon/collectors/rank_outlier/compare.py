"""One step's rank comparison on the exchange thread: the one gather of every rank's
statistics, the test (anomaly/rank_spread.py), and, only when a rank departs, one gather of
the departing statistic's per-tensor values to name the first tensor where it departs.

Every rank reads the same gathered table and decides alike, so the second gather, when there
is one, is made by every rank of the group at the same point."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from ...anomaly.event import RANK_OUTLIER_RULE
from ...anomaly.rank_spread import Spread, first_departing, spread
from ..replica_check.group import exchange
from .statistics import PER_TENSOR, STATISTICS, RankStatistics, Statistic

CALL_ID_LOSS = 1 << 29  # the loss has no row: after the forward rows of its step
OPS = {"actv": "actv_norm", "loss": "loss", "grad": "grad_norm"}


@dataclass
class Departure:
    """One rank's departure in one statistic."""

    stat: Statistic
    value: float
    score: float
    spread: Spread
    column: list[float]  # every rank's value, in group order


@dataclass
class StepOutcome:
    """Who departs in one step, and the per-tensor values gathered to tell where."""

    departures: dict[int, list[Departure]]  # group position -> its departures, in training order
    tensors: dict[str, list[list[float]]]  # statistic key -> per tensor, its ranks' values


def compare_step(mine: RankStatistics, group: Any, ranks: list[int], k: float) -> StepOutcome:
    """This step's departures, every rank's alike. Raises when the ranks' steps do not line up."""
    payload = torch.tensor([mine.step, mine.layout] + [mine.values[s.key] for s in STATISTICS], dtype=torch.float64)
    table = exchange(payload, group, len(ranks))
    if bool((table[:, 0] != mine.step).any()):
        steps = dict(zip(ranks, table[:, 0].tolist()))
        raise RuntimeError(f"the ranks' steps do not line up: {steps}")
    found: dict[int, list[Departure]] = {}
    for j, stat in enumerate(STATISTICS):
        column = table[:, 2 + j].tolist()
        ranks_spread = spread(column)
        if ranks_spread is None:
            continue
        for position, value in enumerate(column):
            score = ranks_spread.score(value)
            if score > k:
                found.setdefault(position, []).append(Departure(stat, value, score, ranks_spread, column))
    tensors: dict[str, list[list[float]]] = {}
    if found and bool((table[:, 1] == table[0, 1]).all()):  # the same tensors on every rank
        firsts = {hits[0].stat.key for hits in found.values()}
        for stat in PER_TENSOR:
            if stat.key in firsts:
                values = torch.tensor(mine.tensors[stat.key].values, dtype=torch.float64)
                tensors[stat.key] = exchange(values, group, len(ranks)).t().tolist()
    return StepOutcome(found, tensors)


def dump_record(
    mine: RankStatistics,
    hits: list[Departure],
    columns: dict[str, list[list[float]]],
    position: int,
    ranks: list[int],
    k: float,
) -> dict[str, Any]:
    """The anomaly-dump record naming this rank (anomaly/event.py's fields, and the spread)."""
    first = hits[0]
    stat = first.stat
    rank = ranks[position]
    name, vpp, call_id, tensor_text = stat.key, 0, CALL_ID_LOSS, ""
    tensor: dict[str, Any] | None = None
    per_tensor = columns.get(stat.key)
    if per_tensor is not None:
        where = first_departing(per_tensor, position, k)
        if where is not None:
            index, score = where
            name, vpp, call_id = mine.tensors[stat.key].names[index]
            values = per_tensor[index]
            median = statistics.median([v for v in values if math.isfinite(v)])
            tensor = {"name": name, "value": values[position], "median": median, "score": score}
            tensor_text = (
                f"; first departing tensor: {name} (norm {values[position]:.6g}, the ranks' median {median:.6g})"
            )
    elif stat.key != "loss":
        name, call_id = f"all {stat.category} tensors", 0
    also = "".join(f"; its {h.stat.said} departs too ({h.score:.3g} deviations)" for h in hits[1:])
    message = (
        f"rank {rank}'s {stat.said} {first.value:.6g} is {first.score:.3g} robust deviations from the ranks' "
        f"median {first.spread.median:.6g} (threshold {k:g}; ranks {ranks}: "
        f"{', '.join(f'{v:.4g}' for v in first.column)}){tensor_text}{also}"
    )
    return {
        "step": mine.step,
        "micro_step": None,
        "vpp_stage": vpp,
        "stage": stat.stage,
        "call_id": call_id,
        "name": name,
        "category": stat.category,
        "op": OPS[stat.key],
        "value": first.value,
        "history": first.spread.median,
        "rule": RANK_OUTLIER_RULE,
        "message": message,
        "statistic": stat.words,
        "score": first.score,
        "scale": first.spread.scale,
        "threshold": k,
        "group_ranks": ranks,
        "rank_values": {str(r): v for r, v in zip(ranks, first.column)},
        "tensor": tensor,
        "also": [
            {"statistic": h.stat.words, "value": h.value, "median": h.spread.median, "score": h.score} for h in hits[1:]
        ],
    }

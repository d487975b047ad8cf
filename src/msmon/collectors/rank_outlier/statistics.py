"""A rank's contribution to the rank comparison, read from its step's rows on the host.

Three rank-local statistics, in the order training makes them:
- `activation norm`: sqrt of the sum of the squared `norm`s of the step's activation rows
  (category actv, every module and micro-step recorded: xy_distribution);
- `loss`: the mean of the step's loss rows (category loss, one per micro-step, recorded by the
  loss collector: loss_distribution; `mean_loss`); absent without them. The rows came to the
  host in the step's one copy: no second copy, nothing computed on the training thread;
- `gradient norm`: the global norm of the rank-local gradient, sqrt of the sum of the squared
  `norm`s of the grad_unreduced rows (wg_distribution; per micro-step rows with
  monitor_mbs_grad: then the root of their squares summed over micro-steps).
A statistic whose rows are not recorded (or without `norm` in ops) is NaN: absent from the
comparison. Per tensor, the same sums over micro-steps give each tensor's value, in the order
its first row was recorded (forward order for activations, the order backward produced the
gradients), to name the first tensor where a rank departs.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from ...records.rows import BACKWARD, FORWARD, RowKey, StepRecord


@dataclass(frozen=True)
class Statistic:
    key: str  # its column in the exchange
    words: str  # its name (the dump record's `statistic`)
    category: str  # the rows it is read from (the dump record's category)
    stage: str
    phrase: str = ""  # as a message says it, when its name alone would mislead

    @property
    def said(self) -> str:
        return self.phrase or self.words


ACTIVATION = Statistic("actv", "activation norm", "actv", FORWARD)
# the value backward ran on: the script's own scaling included (a loss divided by the
# gradient-accumulation steps reads divided), a loss scaler's not (docs/loss.md)
LOSS = Statistic("loss", "loss", "loss", FORWARD, "loss (as passed to backward)")
GRADIENT = Statistic("grad", "gradient norm", "grad_unreduced", BACKWARD)
STATISTICS = (ACTIVATION, LOSS, GRADIENT)  # training order
PER_TENSOR = (ACTIVATION, GRADIENT)  # the ones made of tensors


@dataclass
class Tensors:
    """One statistic's tensors in execution order: (name, vpp stage, first call_id), values."""

    names: list[tuple[str, int, int]] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class RankStatistics:
    step: int
    values: dict[str, float]  # statistic key -> value (NaN: absent)
    tensors: dict[str, Tensors]  # statistic key -> its tensors
    layout: int  # a digest of the tensors' names: equal on every rank that can be compared tensor by tensor


def mean_loss(keys: list[RowKey], table: torch.Tensor) -> float | None:
    """The mean of the step's loss rows (None: none), given the step's whole host batch: the
    loss rows are a feature category of their own column, which the writer takes out of the
    StepRecord it hands on (output/sinks/feature_rows.py), so they are read from the batch."""
    rows = [i for i, key in enumerate(keys) if key.category == LOSS.category]
    if not rows or table.shape[-1] == 0:
        return None
    return float(table[rows, 0].double().mean())  # a loss row holds the loss in every column (loss.py)


def read_statistics(record: StepRecord, loss: float | None) -> RankStatistics:
    """This rank's statistics of `record`'s step, `loss` the mean of its losses (None: absent)."""
    table = record.table
    if table is None:
        table = torch.tensor(record.values, dtype=torch.float64).reshape(len(record.keys), len(record.ops))
    norm = record.ops.index("norm") if "norm" in record.ops else None
    squares = (table[:, norm].double() ** 2).tolist() if norm is not None and len(record.keys) else []
    sums: dict[str, dict[tuple[str, int], list[float]]] = {s.category: {} for s in PER_TENSOR}
    for call_id, (key, square) in enumerate(zip(record.keys, squares)):
        by_tensor = sums.get(key.category)
        if by_tensor is None:
            continue
        entry = by_tensor.get((key.name, key.vpp_stage))
        if entry is None:
            by_tensor[(key.name, key.vpp_stage)] = [square, float(call_id)]
        else:
            entry[0] += square
    values: dict[str, float] = {LOSS.key: math.nan if loss is None else float(loss)}
    tensors: dict[str, Tensors] = {}
    for stat in PER_TENSOR:
        by_tensor = sums[stat.category]
        found = Tensors(
            [(name, vpp, int(entry[1])) for (name, vpp), entry in by_tensor.items()],
            [math.sqrt(entry[0]) for entry in by_tensor.values()],
        )
        tensors[stat.key] = found
        values[stat.key] = math.sqrt(sum(entry[0] for entry in by_tensor.values())) if by_tensor else math.nan
    names = repr([[(n, v) for n, v, _ in tensors[s.key].names] for s in PER_TENSOR]).encode()
    layout = int.from_bytes(hashlib.blake2b(names, digest_size=8).digest(), "big") % ((1 << 52) - 1) + 1
    return RankStatistics(record.step, values, tensors, layout)

"""The report's per-rank outliers: rank-local tensors, where each rank has its own value.

Activations and unreduced gradients differ from rank to rank by design (each rank has its own
batch), so the replicated tensors' spread says nothing about them. What does: at each step and
micro-step, how far one rank's norm lies from the ranks' median, in robust standard deviations
(robust.py: median and MAD). Per tensor, the rank and step where that is largest; the tensors
where it is largest first. Only finite norms count (a non-finite one is the anomaly section's),
and only steps where at least three ranks wrote the tensor (with two, both are as far from
their median). Folded from the value windows (value_window.py) in numpy: per window, the
median and MAD over the rank axis of every (tensor, step, micro-step) at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...records.rows import REPLICATED_CATEGORIES, TENSOR_CATEGORIES
from .limits import Limits
from .rank_stats import robust_z
from .robust import MAD_FLOOR, MAD_SCALE
from .value_window import Window

RANK_LOCAL_CATEGORIES = tuple(c for c in TENSOR_CATEGORIES if c not in REPLICATED_CATEGORIES)
OUTLIER_OP = "norm"
MIN_RANKS = 3


@dataclass
class _Best:
    z: float
    rank: int
    step: int
    micro: int
    value: float
    median: float
    mad: float
    ranks: int


class OutlierFold:
    """Each rank-local tensor's largest robust z, over the windows folded in."""

    def __init__(self, ops: list[str]) -> None:
        self.op = ops.index(OUTLIER_OP)
        self.best: dict[tuple[str, int, str], _Best] = {}
        self.compared: set[tuple[str, int, str]] = set()
        self.max_ranks = 0

    def add(self, window: Window, tensors: list[tuple[int, str]], first_micro: int) -> None:
        if window.category not in RANK_LOCAL_CATEGORIES:
            return
        value = window.value[:, self.op]  # (rank rows, tensors, steps, micro)
        valid = window.finite[:, self.op]
        shape = value.shape[1:]
        value, valid = value.reshape(value.shape[0], -1), valid.reshape(valid.shape[0], -1)
        n = np.count_nonzero(valid, axis=0)
        for t in np.unique(np.unravel_index(np.flatnonzero(n), shape)[0]):
            self.compared.add((window.category, *tensors[int(t)]))
        if n.size:
            self.max_ranks = max(self.max_ranks, int(n.max()))
        enough = n >= MIN_RANKS
        if not enough.any():
            return
        if enough.all() and int(n.min()) == value.shape[0]:  # every rank row has a finite norm everywhere
            cells, x = np.arange(n.size), value
        else:
            cells = np.flatnonzero(enough)
            x = np.where(valid[:, cells], value[:, cells], np.nan)  # (rank rows, cells)
        z, med, mad = robust_z(x)
        z = np.where(np.isnan(z), -np.inf, z)
        row = np.argmax(z, axis=0)  # the first rank row with the largest z of each cell
        cell_z = z[row, np.arange(cells.size)]
        tensor = np.unravel_index(cells, shape)[0]  # non-decreasing: a tensor's cells lie together
        starts = np.flatnonzero(np.r_[True, tensor[1:] != tensor[:-1]])
        for start, end in zip(starts, np.r_[starts[1:], cells.size]):
            k = int(start + np.argmax(cell_z[start:end]))
            key = (window.category, *tensors[int(tensor[k])])
            have = self.best.get(key)
            if have is not None and not cell_z[k] > have.z:
                continue
            _, s, m = np.unravel_index(cells[k], shape)
            self.best[key] = _Best(
                float(cell_z[k]),
                int(window.slot_ranks[row[k]]),
                window.first + int(s),
                int(m) + first_micro,
                float(x[row[k], k]),
                float(med[k]),
                float(mad[k]),
                int(n[cells[k]]),
            )

    def result(self, limits: Limits) -> dict[str, Any]:
        """The top Limits.rank_outliers tensors by their largest robust z over ranks."""
        top = sorted(self.best.items(), key=lambda kv: (-kv[1].z, kv[0][0], kv[0][2]))[: limits.rank_outliers]
        return {
            "categories": list(RANK_LOCAL_CATEGORIES),
            "op": OUTLIER_OP,
            "min_ranks": MIN_RANKS,
            "mad_scale": MAD_SCALE,
            "mad_floor": MAD_FLOOR,
            "tensors": len(self.compared),
            "max_ranks": self.max_ranks,
            "top": [
                {
                    "category": category,
                    "vpp_stage": vpp,
                    "name": name,
                    "rank": b.rank,
                    "step": b.step,
                    "micro_step": None if b.micro < 0 else b.micro,
                    "value": b.value,
                    "median": b.median,
                    "mad": b.mad,
                    "ranks": b.ranks,
                    "z": b.z,
                }
                for (category, vpp, name), b in top
            ],
        }

"""The trackers' lanes: a rank's few hundred numbers per recorded step, and the step's lanes
made of every rank's on the logging rank.

A rank's numbers (`LaneReader`, on the writer thread, from the step's record: the output's
own values, each category with the ops it keeps): per category and op the max over the
category's rows, a NaN counting as the largest (summary_lanes.category_maxima, as the by_rank
TensorBoard lanes), the row holding it, the median over the rows (NaNs left out; the mean of the
two middle values for an even count), and the rows' count; the mean of the step's loss rows
(loss_distribution); the alerts this rank raised since its last step, and the size of the
alerts that go with them (verdict.py). Every category and op of the table has its place, so
every rank's numbers have one layout and stack in one gather.

The step's lanes (`LaneCombiner`, on the logging rank): per category and op the max over the
ranks (NaN first; a tie goes to the lowest rank) with the rank and tensor holding it, and the
median over the ranks of their medians (the median over all tensors where the ranks hold the
same values, as for replicated weights and reduced gradients); the loss as min/median/max over
the ranks; the alerts summed and their total so far; the step's level (`msmon/verdict`, a
number to plot): `nonfinite` when a lane's max or a loss is NaN or infinite, `alert` when a rank
raised an alert, else `ok`; the verdict (`msmon/verdict_text`): the kind of fault once every
rank's alerts so far tell one (verdict.py), else the level. The kind told (and each change of
it) and the first step at each level are announced (a W&B alert, MLflow tags), saying what
happened, and so is each escalation of alert.actions (the logging rank's own, as every rank
knows them).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
from dataclasses import dataclass, field

import torch

from ...anomaly.data_path import PathEvent
from ...anomaly.fault_kind import FaultKind
from ...config.schema import STATISTIC_CATEGORIES
from ...output.category_ops import CategoryColumns
from ...output.sinks.summary_lanes import CategoryRows, category_maxima
from ...output.sinks.tracker import VERDICTS, Escalated, StepLanes, verdict_text
from ...records.rows import RowKey, StepRecord
from ...stats.ops import OPS
from .verdict import FirstAnomaly, same_kind

CATEGORIES = STATISTIC_CATEGORIES
LANE_OPS = tuple(OPS)
STEP, LAYOUT, ALERTS, LOSS, HAS_LOSS, ALERT_BYTES = range(6)
HEAD = 6
FIELDS = 4  # per category and op: max, the row holding it, median, rows
SIZE = HEAD + FIELDS * len(CATEGORIES) * len(LANE_OPS)
_CATEGORY = {c: i for i, c in enumerate(CATEGORIES)}
_OP = {op: i for i, op in enumerate(LANE_OPS)}


@dataclass
class RankLanes:
    """A rank's numbers of one step (the exchange thread's job)."""

    step: int
    payload: torch.Tensor  # [SIZE] float64
    names: dict[str, list[str]]  # category -> its rows' tensors, in row order (to name a max's holder)
    tensors: dict[str, float] = field(default_factory=dict)  # the explicit tensors (the logging rank's)
    alerts: bytes = b""  # its alerts that may decide the kind (verdict.py), encoded
    escalations: list[Escalated] = field(default_factory=list)  # started since the last step (the logging rank's)


def digest(names: dict[str, list[str]]) -> float:
    """A number equal on ranks whose rows are the same tensors (exact in a float64)."""
    raw = hashlib.blake2b(json.dumps(names, sort_keys=True).encode(), digest_size=8).digest()
    return float(int.from_bytes(raw, "big") % ((1 << 52) - 1) + 1)


class LaneReader:
    """A rank's numbers of each step; `patterns` (tracker.tensors) picks explicit tensors, read
    only where `explicit` (the logging rank)."""

    def __init__(self, columns: CategoryColumns, patterns: list[str], explicit: bool) -> None:
        self.columns = columns
        self.patterns = patterns if explicit else []
        self._rows = CategoryRows()
        self._groups: object = None
        self._names: dict[str, list[str]] = {}
        self._digest = 0.0
        self._picked: list[tuple[int, RowKey]] = []

    def read(self, record: StepRecord, loss: float | None, alerts: int, told: bytes = b"") -> RankLanes:
        table = record.table
        if table is None or tuple(table.shape) != (len(record.keys), len(record.ops)):
            table = torch.tensor(record.values, dtype=torch.float64).reshape(len(record.keys), len(record.ops))
        table = table.double()
        payload = torch.full((SIZE,), math.nan, dtype=torch.float64)
        payload[STEP], payload[ALERTS] = record.step, alerts
        payload[LOSS], payload[HAS_LOSS] = (loss, 1.0) if loss is not None else (math.nan, 0.0)
        payload[ALERT_BYTES] = len(told)
        groups = self._rows.groups(record.keys)
        if groups is not self._groups:  # the rows changed: their names and the explicit tensors too
            self._groups = groups
            self._names = {c: [record.keys[i].display_name() for i in index] for c, index, _ in groups}
            self._digest = digest(self._names)
            self._picked = [(i, k) for i, k in enumerate(record.keys) if self._wanted(k)]
        payload[LAYOUT] = self._digest
        places: list[int] = []
        numbers: list[torch.Tensor] = []
        for category, index, rows in groups:
            place = _CATEGORY.get(category)
            kept = self.columns.kept(category, record.ops)
            if place is None or not kept:
                continue
            columns = torch.tensor([record.ops.index(op) for op in kept])
            maxima, holders = category_maxima(table.index_select(1, columns), rows)
            medians = torch.nanquantile(table.index_select(0, rows).index_select(1, columns), 0.5, dim=0)
            for j, op in enumerate(kept):
                base = HEAD + FIELDS * (place * len(LANE_OPS) + _OP[op])
                places.extend(range(base, base + FIELDS))
                numbers.append(torch.stack([maxima[j], holders[j].double(), medians[j]]))
                numbers.append(torch.tensor([float(len(index))], dtype=torch.float64))
        if places:
            payload[torch.tensor(places)] = torch.cat(numbers)
        return RankLanes(record.step, payload, self._names, self._tensors(record, table), told)

    def _wanted(self, key: RowKey) -> bool:
        text = f"{key.category}/{key.name}"
        return any(fnmatch.fnmatchcase(text, pattern) for pattern in self.patterns)

    def _tensors(self, record: StepRecord, table: torch.Tensor) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, key in self._picked:
            name = key.name + (f"/vpp{key.vpp_stage}" if key.vpp_stage else "")
            name += f"/micro{key.micro_step}" if key.micro_step is not None else ""
            for op in self.columns.kept(key.category, record.ops):
                out[f"msmon/tensor/{key.category}/{name}/{op}"] = float(table[i, record.ops.index(op)])
        return out


class LaneCombiner:
    """The step's lanes from every rank's numbers ([ranks, SIZE], in `ranks`' order), on the
    logging rank; keeps the alert total, the highest level and the alerts that tell the kind."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.alerts_total = 0
        self.level = 0  # the highest level so far
        self.first = FirstAnomaly(ranks)
        self.kind: FaultKind | None = None  # the kind told so far

    def combine(
        self,
        table: torch.Tensor,
        names: list[dict[str, list[str]]],
        tensors: dict[str, float],
        events: list[PathEvent] | None = None,
        escalations: list[Escalated] | None = None,
    ) -> StepLanes:
        """`events`: every rank's alerts that came with this step (verdict.py); `escalations`:
        those of alert.actions that started since the last step."""
        lanes = StepLanes(int(table[0, STEP]), escalations=list(escalations or []))
        self._kind(lanes, events or [])
        alerts = table[:, ALERTS]
        self.alerts_total += int(alerts.sum())
        lanes.values.update({"msmon/alerts": float(alerts.sum()), "msmon/alerts_total": float(self.alerts_total)})
        troubles = self._loss(table, lanes)
        texts: dict[str, str] = {}
        blocks = table[:, HEAD:].reshape(len(self.ranks), len(CATEGORIES) * len(LANE_OPS), FIELDS)
        present = blocks[:, :, 3] > 0
        maxima = torch.where(present, blocks[:, :, 0], torch.tensor(-math.inf, dtype=torch.float64))
        nan = torch.isnan(maxima)
        finite_max, finite_at = torch.where(nan, -math.inf, maxima).max(dim=0)
        holder_at = torch.where(nan.any(dim=0), nan.int().argmax(dim=0), finite_at)
        medians = torch.nanquantile(torch.where(present, blocks[:, :, 2], math.nan), 0.5, dim=0)
        for k in torch.nonzero(present.any(dim=0)).flatten().tolist():
            category, op = CATEGORIES[k // len(LANE_OPS)], LANE_OPS[k % len(LANE_OPS)]
            at = int(holder_at[k])
            value = float(maxima[at, k])
            tensor = names[at].get(category, [])
            row = int(blocks[at, k, 1])
            holder = tensor[row] if 0 <= row < len(tensor) else "?"
            lane = f"msmon/{category}/{op}"
            lanes.values[f"{lane}_max"] = value
            lanes.values[f"{lane}_median"] = float(medians[k])
            lanes.values[f"{lane}_max_rank"] = float(self.ranks[at])
            texts[f"{lane}_max_tensor"] = holder
            if not math.isfinite(value):
                troubles.append(f"{category} {op} {value} on rank {self.ranks[at]} ({holder})")
        lanes.values.update(texts)
        lanes.values.update(tensors)
        self._verdict(lanes, troubles, alerts)
        return lanes

    def _loss(self, table: torch.Tensor, lanes: StepLanes) -> list[str]:
        """The loss lanes (min, median, max over the ranks that have one); the non-finite ones."""
        has = table[:, HAS_LOSS] > 0
        if not bool(has.any()):
            return []
        losses = table[has, LOSS]
        ranks = [r for r, h in zip(self.ranks, has.tolist()) if h]
        lanes.values["msmon/loss/min"] = float(losses.min())
        lanes.values["msmon/loss/median"] = float(torch.nanquantile(losses, 0.5))
        lanes.values["msmon/loss/max"] = float(losses.max())
        return [f"loss {v} on rank {r}" for r, v in zip(ranks, losses.tolist()) if not math.isfinite(v)]

    def _kind(self, lanes: StepLanes, events: list[PathEvent]) -> None:
        """The kind told by every rank's alerts so far; `told` where it is new or changed."""
        if events and self.first.add(events):
            kind = self.first.kind()
            if kind is not None and not same_kind(kind, self.kind):
                self.kind, lanes.told = kind, True
        lanes.kind = self.kind

    def _verdict(self, lanes: StepLanes, troubles: list[str], alerts: torch.Tensor) -> None:
        raised = [r for r, n in zip(self.ranks, alerts.tolist()) if n > 0]
        level = 2 if troubles else 1 if raised else 0
        lanes.level = VERDICTS[level]
        lanes.verdict = lanes.kind.code if lanes.kind is not None else lanes.level
        text = verdict_text(lanes.kind, lanes.level)
        lanes.values = {"msmon/verdict": float(level), "msmon/verdict_text": text, **lanes.values}
        if level > self.level:
            self.level = level
            said = []
            if troubles:
                more = f" and {len(troubles) - 1} more" if len(troubles) > 1 else ""
                said.append(f"non-finite: {troubles[0]}{more}")
            if raised:
                said.append(f"{int(alerts.sum())} alerts on ranks {raised}")
            lanes.rise = "; ".join(said)

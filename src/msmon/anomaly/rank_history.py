"""AnomalyRankOutlier's second test: a rank against its own recent history, relative to the others.

The ranks' median and MAD (rank_spread.py) need three ranks, and miss a fault on half of them. So
each rank is also compared with its own past. For one statistic (activation norm, loss, gradient
norm) of rank r at a step, with l = ln|x|:

    own        z_own = |l_r - m_r| / s_r                    the rank against its own history
    relative   d_r = l_r - median(l_j, j != r)              its log-ratio to the other ranks
               z_rel = |d_r - m'_r| / s'_r                  against that ratio's history

Rank r is named when z_own > k and z_rel > k, both the same way (it jumped, and the others did not
jump with it), with k the rule's threshold. With two ranks the other's own value must also stay
within its own history (z_own <= k there): a rank whose statistics jump while the other's do not.
A learning-rate warm-up, clipping or a loss falling fast moves every rank alike: the ratio does
not move, nobody is named. Healthy ranks fed different data, with dropout: each history learns
how much its own values and ratios wander, and the bar rises with it.

History: per rank and statistic, a bias-corrected exponential moving average of l (a = ALPHA,
about the last three steps: a loss that falls fast is followed), m_n = EMA_n / (1 - (1 - a)^n),
and one of its squared deviation (l - m)^2, taken before l enters, with a slower a = DEVIATION_ALPHA
(about the last twenty steps: a rank whose values wander keeps a wide band between its wanderings);
s = max(sqrt(that), LOG_FLOOR). LOG_FLOOR = ln(1 + FLOOR) = 0.14, FLOOR the median/MAD test's 15 %:
with the default k = 5 nobody is named below a factor of exp(5 * 0.14) = 2.0 against its own
past, and below the same factor in its ratio to the others.
No test before WARMUP (8) values have entered a history (a scale of fewer is a guess). The values of a rank named for a
statistic do not enter its history, and no ratio enters at a step where anyone was named, so a
lasting fault stays named (as with the median test) instead of becoming the new normal. A
non-finite or zero value neither enters nor is tested (AnomalyNan's business). The loss enters as
ln|loss|: a change of sign alone is not seen here.

Every rank of the exchange keeps the same histories of every rank (they read the same gathered
table, in the same order), so all decide alike. Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from .rank_spread import FLOOR

ALPHA = 0.3
DEVIATION_ALPHA = 0.05
WARMUP = 8
LOG_FLOOR = math.log1p(FLOOR)


@dataclass
class History:
    """An exponential moving average of a log value and of its squared deviation."""

    total: float = 0.0
    deviation: float = 0.0  # the EMA of (l - m)^2
    n: int = 0  # values entered
    deviations: int = 0  # deviations entered (one fewer: the first value has nothing to deviate from)

    @property
    def warm(self) -> bool:
        return self.n >= WARMUP

    @property
    def mean(self) -> float:
        return self.total / (1.0 - (1.0 - ALPHA) ** self.n) if self.n else math.nan

    @property
    def scale(self) -> float:
        spread = self.deviation / (1.0 - (1.0 - DEVIATION_ALPHA) ** self.deviations) if self.deviations else 0.0
        return max(math.sqrt(spread), LOG_FLOOR)

    def score(self, value: float) -> float:
        """Signed: how many scales `value` lies above (or below) the history; NaN while warming up."""
        if not self.warm or not math.isfinite(value):
            return math.nan
        return (value - self.mean) / self.scale

    def enter(self, value: float) -> None:
        if not math.isfinite(value):
            return
        if self.n:
            self.deviation = (1.0 - DEVIATION_ALPHA) * self.deviation + DEVIATION_ALPHA * (value - self.mean) ** 2
            self.deviations += 1
        self.total = (1.0 - ALPHA) * self.total + ALPHA * value
        self.n += 1


def log_magnitude(value: float) -> float:
    """ln|value|, NaN for a non-finite or zero value."""
    return math.log(abs(value)) if math.isfinite(value) and value != 0 else math.nan


@dataclass(frozen=True)
class HistoryDeparture:
    """Rank `position` departs from its own history in one statistic."""

    position: int
    score: float  # z_own, signed
    relative_score: float  # z_rel, signed
    recent: float  # exp(m): its own recent value
    ratio: float  # exp(d): its value over the other ranks' median now
    usual_ratio: float  # exp(m'): that ratio as it usually is
    others: float  # the other ranks' median value


@dataclass
class RankHistory:
    """The histories of every rank of the exchange, by statistic (the gathered table's columns)."""

    ranks: int
    k: float
    own: dict[str, list[History]] = field(default_factory=dict)
    relative: dict[str, list[History]] = field(default_factory=dict)

    def step(self, key: str, column: Sequence[float], named: Collection[int] = ()) -> list[HistoryDeparture]:
        """The ranks of one statistic's column (in group order) that depart from their own
        history; `named`: positions the ranks' spread names already (their values do not enter).
        Enters this step's values into the histories."""
        own = self.own.setdefault(key, [History() for _ in range(self.ranks)])
        relative = self.relative.setdefault(key, [History() for _ in range(self.ranks)])
        logs = [log_magnitude(v) for v in column]
        ratios = [self._ratio(logs, r) for r in range(self.ranks)]
        scores = [own[r].score(logs[r]) for r in range(self.ranks)]
        found = []
        for r in range(self.ranks):
            z_own, z_rel = scores[r], relative[r].score(ratios[r])
            if not (abs(z_own) > self.k and abs(z_rel) > self.k and (z_own > 0) == (z_rel > 0)):
                continue
            if self.ranks == 2 and not abs(scores[1 - r]) <= self.k:
                continue  # both jumped (or the other cannot be told): neither is the odd one out
            others = [column[j] for j in range(self.ranks) if j != r and not math.isnan(logs[j])]
            found.append(
                HistoryDeparture(
                    r,
                    z_own,
                    z_rel,
                    math.exp(own[r].mean),
                    math.exp(ratios[r]),
                    math.exp(relative[r].mean),
                    statistics.median(others),
                )
            )
        spoilt = set(named) | {d.position for d in found}
        for r in range(self.ranks):
            if r not in spoilt:
                own[r].enter(logs[r])
            if not spoilt:
                relative[r].enter(ratios[r])
        return found

    @staticmethod
    def _ratio(logs: list[float], r: int) -> float:
        others = [v for j, v in enumerate(logs) if j != r and not math.isnan(v)]
        if math.isnan(logs[r]) or not others:
            return math.nan
        return logs[r] - statistics.median(others)


@dataclass
class TensorHistory:
    """One rank's own history of each of its tensors' norms, to name the first tensor where it
    departs from its own past (the rank's alone: nothing is exchanged for it)."""

    k: float
    tensors: dict[tuple, History] = field(default_factory=dict)

    def first_departing(
        self, names: Sequence[tuple], values: Sequence[float], upward: bool
    ) -> tuple[int, float] | None:
        """(index, score) of the first tensor, in the order given, whose value departs from its
        history by more than k the way the statistic did; else the one that departs most that way;
        None when no tensor has a history yet."""
        best: tuple[int, float] | None = None
        for index, (name, value) in enumerate(zip(names, values)):
            history = self.tensors.get(name)
            score = history.score(log_magnitude(value)) if history is not None else math.nan
            if math.isnan(score):
                continue
            signed = score if upward else -score
            if signed > self.k:
                return index, abs(score)
            if best is None or signed > best[1]:
                best = (index, signed)
        return None if best is None else (best[0], abs(best[1]))

    def enter(self, names: Sequence[tuple], values: Sequence[float]) -> None:
        for name, value in zip(names, values):
            self.tensors.setdefault(name, History()).enter(log_magnitude(value))

"""Reading the gradient agreement across ranks: cos and norm_ratio together (torch-free).

grad_agreement gives each rank r its cos c_r = <g_r, G> / (|g_r| |G|) and its norm_ratio
q_r = |g_r| / |G|, g_r its rank-local gradient and G = (1/N) sum g_i the average the reduction
leaves on every rank. Read alone, cos misleads: a rank fed inputs x40 among four has a gradient
so large that the average is mostly its own, so its cos stays high (0.8) while the healthy ranks'
fall to about 0 (their gradients are small beside it). What points at it is its norm_ratio
(about N, the others' near 0). And from the two numbers of one rank, without any other
collective, follow how it agrees with the *others* (in units of |G|):

    |S_-r|^2 = N^2 - 2 N c_r q_r + q_r^2          S_-r = sum of the others' gradients = N G - g_r
    cos(g_r, S_-r) = (N c_r - q_r) / |S_-r|       the rank against the others' average
    A_-r = |S_-r| / sum_(i != r) q_i              how much the others agree among themselves,
                                                  without r: |sum g_i| / sum |g_i| over i != r

A_-r is 1 when the others' gradients all point the same way, and falls with the noise of each
rank's batch. Beside it, the others' mean cos with the reduced gradient says how much they agree
with the average that r is part of: when it is far below A_-r, the others agree among
themselves and not with the average, which r has made its own. A healthy rank's cos is low when
its batch's gradient is mostly noise (small batches, late in training) or when another rank
dominates the average; it is not a sign of its own data.

A rank dominates the reduced gradient at a step when its norm_ratio leaves the others' (the
rank-outlier rule's median test, anomaly/rank_spread.py, with the same threshold k: from three
ranks; the gradient-norm statistic of that rule, seen from the agreement) and its removal makes the
others agree (A_-r above their mean cos with the reduced gradient); with two ranks, when its
norm_ratio is more than 1 + FLOOR * k (1.75 with k = 5) times the other's (which of two is wrong,
one step cannot tell; AnomalyRankOutlier's history test can).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .rank_spread import DEFAULT_K, FLOOR, MAD_SCALE


@dataclass(frozen=True)
class StepAgreement:
    """One step's agreement as the ranks' rows give it: the rank with the largest norm_ratio,
    its cos, the ranks' norm_ratio median, MAD and sum, and the sum of their cos."""

    step: int
    ranks: int  # N: the ranks with a finite row at this step
    rank: int  # the rank with the largest norm_ratio
    cos: float
    ratio: float
    median_ratio: float
    mad_ratio: float
    ratio_sum: float
    cos_sum: float

    @property
    def others_norm(self) -> float:
        """|S_-r| / |G|: the others' summed gradient, in units of the average."""
        n, c, q = self.ranks, self.cos, self.ratio
        return math.sqrt(max(n * n - 2 * n * c * q + q * q, 0.0))

    def cos_with_others(self) -> float:
        """cos(g_r, S_-r): the rank's gradient against the others' average."""
        norm = self.others_norm
        return (self.ranks * self.cos - self.ratio) / norm if norm > 0 else math.nan

    def others_cos(self) -> float:
        """The other ranks' mean cos with the reduced gradient."""
        return (self.cos_sum - self.cos) / (self.ranks - 1) if self.ranks > 1 else math.nan

    def agreement_without(self) -> float:
        """A_-r: the others' agreement without the rank."""
        rest = self.ratio_sum - self.ratio
        return self.others_norm / rest if rest > 0 else math.nan

    def other_ratio(self) -> float:
        """With two ranks: the other rank's norm_ratio."""
        return 2 * self.median_ratio - self.ratio

    def score(self) -> float:
        """How far its norm_ratio leaves the others' (robust deviations; with two ranks, the
        factor over the other's)."""
        if self.ranks == 2:
            other = self.other_ratio()
            return self.ratio / other if other > 0 else math.inf
        scale = max(MAD_SCALE * self.mad_ratio, FLOOR * abs(self.median_ratio))
        return abs(self.ratio - self.median_ratio) / scale if scale > 0 else math.nan

    def dominates(self, k: float = DEFAULT_K) -> bool:
        """The rank's gradient dominates the reduced one (the module's docstring says when)."""
        if self.ranks < 2 or not all(map(math.isfinite, (self.cos, self.ratio, self.median_ratio))):
            return False
        if self.ranks == 2:
            return self.score() > 1 + FLOOR * k
        return self.score() > k and self.ratio > self.median_ratio and self.agreement_without() > self.others_cos()

    def describe(self) -> str:
        """In words, for the report."""
        if self.ranks == 2:
            return (
                f"rank {self.rank}'s gradient is {self.score():.3g} times the other's (norm_ratio {self.ratio:.3g} "
                f"against {self.other_ratio():.3g}): it dominates the reduced gradient, so its cos stays at "
                f"{self.cos:.3g} while the other's falls; with two ranks one step cannot tell which is wrong "
                "(AnomalyRankOutlier's history test can)"
            )
        return (
            f"rank {self.rank} dominates the reduced gradient: its norm_ratio {self.ratio:.3g} against the ranks' "
            f"median {self.median_ratio:.3g} ({self.score():.3g} robust deviations); its cos with the reduced "
            f"gradient is {self.cos:.3g}, with the other ranks' average {self.cos_with_others():.3g}; the others' cos "
            f"with the reduced gradient averages {self.others_cos():.3g}, while among themselves, without it, they "
            f"agree at {self.agreement_without():.3g}. Their low cos says that one rank's gradient outweighs theirs, "
            "not that their data departs"
        )

"""AnomalyRankOutlier: the data-parallel rank whose rank-local statistics leave the ranks' spread.

Rank-local tensors (unreduced gradients, activations, the loss) differ across data-parallel
ranks by design, since each rank trains on its own batch; what no rank should be is far from
all the others. Each recorded step every rank contributes three numbers (statistics.py: its
activation norm, loss and gradient norm), read on the writer thread from the step's rows once
the step's one device-to-host copy has brought them there (the loss from the loss rows, so
only with loss_distribution: the rule makes no copy of its own); a thread of this rank
exchanges them in one all_gather on msmon's own gloo group over the data-parallel ranks, and
names a rank that leaves the robust spread (anomaly/rank_spread.py), with the first tensor where
it departs (compare.py). The training thread does nothing for the rule but its setup.

The group is the replica check's data-parallel group (replica_check/group.py's
`replica_group`: set_monitor's dp_group, a framework's, DDP's), found at the first recorded
step, when the model is wrapped; the exchange has its own gloo group over the recording ranks
of it, and its thread is runtime/exchange_thread.py's. From three ranks a rank is named when it
leaves the ranks' robust spread (rank_spread.py) or its own history relative to the others
(rank_history.py: a fault on several ranks at once); with two, by its own history alone (which of
two is the odd one out only their pasts tell). One recording rank (no data parallelism) switches
the rule off with one line. The rule's settings are read when the monitor attaches; edits while training runs are
ignored (every rank must keep comparing the same steps).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ...anomaly.event import RANK_OUTLIER_RULE
from ...anomaly.rank_history import RankHistory, TensorHistory
from ...anomaly.rank_spread import DEFAULT_K
from ...anomaly.seen import from_record
from ...output.handoff import StepConsumer
from ...runtime.actions.board import RANK_OUTLIER, ActionBoard
from ...runtime.exchange_thread import ExchangeThread
from ..base import Collector
from ..registry import register
from ..replica_check.group import EXCHANGES, own_group, replica_group
from .compare import compare_step, dump_record, enter_tensors
from .statistics import RankStatistics, mean_loss, read_statistics

if TYPE_CHECKING:
    from ...config import MonitorConfig
    from ...output.handoff import HostRows
    from ...records.rows import StepRecord
    from ...runtime.step_context import StepContext

logger = logging.getLogger("msmon")

MIN_RANKS = 2  # two ranks are compared through their own histories (anomaly/rank_history.py)

KEY = "rank_outlier"
FLUSH_SECONDS = 60.0  # when the writer closes, how long to wait for the last comparisons


def rule_threshold(cfg: MonitorConfig) -> float | None:
    """The rule's k when `alert.rules` holds AnomalyRankOutlier, else None."""
    for rule in cfg.alert.rules:
        if rule.rule_name == RANK_OUTLIER_RULE:
            return rule.threshold if rule.threshold is not None else DEFAULT_K
    return None


@dataclass
class OutlierState:
    """What survives collector rebuilds: the settings read at attach, the group, the thread."""

    k: float
    resolved: bool = False
    off: str | None = None
    group: Any = None
    ranks: list[int] = field(default_factory=list)
    exchange: ExchangeThread[RankStatistics] = field(default_factory=ExchangeThread)
    alarms: int = 0  # steps at which this rank was named
    history: RankHistory | None = None  # every rank's own history of the three statistics
    tensors: TensorHistory | None = None  # this rank's own history of each of its tensors


@register(key=KEY, category="check", order=125, enabled=lambda cfg, ctx: rule_threshold(cfg) is not None)
class RankOutlierCollector(Collector):
    name = "rank outlier rule"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        state = ctx.kept.get(KEY)
        if state is None:
            state = ctx.kept[KEY] = OutlierState(rule_threshold(ctx.config) or DEFAULT_K)
        self.state: OutlierState = state

    def after_update(self) -> None:
        if self.ctx.recording:
            self._resolve()  # the rows are read on the writer thread (StatisticsConsumer)

    # -- setup, once, at the first recorded step (the model is wrapped by then) -----------------
    def _resolve(self) -> bool:
        state, ctx = self.state, self.ctx
        if state.resolved:
            return state.off is None
        state.resolved = True
        if not (dist.is_available() and dist.is_initialized()):
            return self._off("torch.distributed is not initialised: there are no other ranks to compare with")
        group = replica_group(ctx)
        if group is None:
            return self._off("no data-parallel group is known (no DDP module, no framework group, no dp_group)")
        ranks = list(dist.get_process_group_ranks(group))
        if ctx.config.module_ranks:  # ranks outside module_ranks record nothing: leave them out
            ranks = [r for r in ranks if r in set(ctx.config.module_ranks)]
        if len(ranks) < MIN_RANKS or ctx.rank not in ranks:
            return self._off(
                f"the data-parallel group has {len(ranks)} recording rank(s); comparing needs at least {MIN_RANKS}"
            )
        try:
            state.group = own_group(ranks, "rank_outlier")
            EXCHANGES.append(state)
        except Exception as exc:  # gloo cannot connect, say: the rule is off, training goes on
            return self._off(f"creating msmon's gloo group over ranks {ranks} failed: {exc!r}", error=True)
        state.ranks = list(dist.get_process_group_ranks(state.group))
        state.history, state.tensors = RankHistory(len(state.ranks), state.k), TensorHistory(state.k)
        board = ctx.board
        state.exchange.start(
            f"msmon-outlier-rank{ctx.rank}",
            ctx.rank,
            state,
            self._compare,
            RANK_OUTLIER_RULE,
            "comparing the ranks",
            failed=lambda: board.retire(RANK_OUTLIER),
        )
        ctx.watch_steps(StatisticsConsumer(state, board))
        logger.info(
            "msmon[rank %d]: %s compares data-parallel ranks %s every recorded step (threshold %g; %s)%s",
            ctx.rank,
            RANK_OUTLIER_RULE,
            state.ranks,
            state.k,
            "each rank against its own history and the other's"
            if len(state.ranks) == 2
            else "the ranks' median and MAD, and each rank against its own history",
            "" if ctx.config.loss_distribution else "; no loss compared: it is read from loss_distribution's rows",
        )
        return True

    def _off(self, reason: str, error: bool = False) -> bool:
        self.state.off = reason
        (logger.error if error else logger.info)("msmon[rank %d]: %s off: %s", self.ctx.rank, RANK_OUTLIER_RULE, reason)
        return False

    # -- the exchange (this rank's thread: runtime/exchange_thread.py) ------------------------------
    def _compare(self, mine: RankStatistics) -> None:
        try:
            self._compare_step(mine)
        finally:
            self.ctx.board.done(RANK_OUTLIER, mine.step)  # alert.actions: this rank's comparison of the step is in

    def _compare_step(self, mine: RankStatistics) -> None:
        state, ctx = self.state, self.ctx
        assert state.history is not None and state.tensors is not None  # set with the group, before the thread
        outcome = compare_step(mine, state.group, state.ranks, state.k, state.history)
        position = state.ranks.index(ctx.rank)
        hits = outcome.departures.get(position) or []
        record = (
            dump_record(mine, hits, outcome.tensors, position, state.ranks, state.k, state.tensors) if hits else None
        )
        enter_tensors(mine, state.tensors, hits)
        if record is None:
            return
        state.alarms += 1
        ctx.board.saw([from_record({**record, "rank": ctx.rank})])
        statistic = f"rank {ctx.rank}'s {record['statistic']}"  # one line per statistic, its repeats counted
        if ctx.alert_repeats.first((RANK_OUTLIER_RULE, record["statistic"]), RANK_OUTLIER_RULE, statistic, mine.step):
            logger.warning(
                "msmon alert [rank %d] step %d (%s): %s", ctx.rank, mine.step, RANK_OUTLIER_RULE, record["message"]
            )
        dump = ctx.anomaly_dump()
        if dump is not None:
            try:
                dump.append([record])
            except OSError as exc:
                logger.error("msmon[rank %d]: writing the rank outlier to the anomaly dump failed: %s", ctx.rank, exc)


class StatisticsConsumer(StepConsumer):
    """On the writer thread: this rank's statistics of each written step, handed to the exchange
    thread (the writer never waits for the other ranks)."""

    name = "rank outlier"

    def __init__(self, state: OutlierState, board: ActionBoard) -> None:
        self.state = state
        self.board = board

    @property
    def alerts_raised(self) -> int:  # type: ignore[override]  # a count kept by the exchange thread
        return self.state.alarms

    def consume(self, record: StepRecord, batch: HostRows) -> None:
        if self.state.off is None:
            self.board.expect(RANK_OUTLIER, record.step)  # before the writer says it read the step
            self.state.exchange.put(read_statistics(record, mean_loss(batch.keys, batch.values)))

    def writer_closed(self) -> None:
        """Wait (a bounded time) for the comparisons of the last steps."""
        left = self.state.exchange.flush(FLUSH_SECONDS)
        if left:
            logger.warning(
                "msmon: %d rank comparison(s) still waiting for the other ranks after %.0f s; not reported",
                left,
                FLUSH_SECONDS,
            )

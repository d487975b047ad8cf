"""The tracker formats' lanes (`format: [..., "wandb"]`, `"mlflow"`): every rank's numbers of each
recorded step gathered on one rank, which logs the step's lanes to each tracker.

As the rank comparison (collectors/rank_outlier/) does: each rank reads its numbers from its
written step on the writer thread (lanes.py: a few hundred floats, from the rows the step's one
device-to-host copy brought), and a thread of its own (runtime/exchange_thread.py) gathers them
in one all_gather on msmon's own gloo group over the recording ranks (made, at the first
recorded step, on the training thread, where every rank makes its groups in the same order).
The tensors' names travel only when a rank's rows change (a digest says so); a rank's alerts
that may decide the kind of fault (verdict.py) travel in one more gather, to the logging rank
alone, only at steps where a rank has some. The lowest recording rank (global rank 0 as a
rule) combines them into the step's lanes and logs them: the
tracker clients are imported and their runs connected there alone, on that thread, and the
training thread does nothing for it but notice, at that first step, a run the script made
(MLflow keeps its active run per thread). One process alone logs its own numbers.

A failing tracker is switched off alone, with one line; the gather goes on for the others.
The settings are read when the monitor attaches; edits while training runs are ignored. When
the monitor closes, after its writer wrote the last step and the gathers of the last steps are
done (a bounded wait), the runs msmon made are finished.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ...output.category_ops import CategoryColumns
from ...output.handoff import HostRows, StepConsumer
from ...output.sinks import format_names, sink_class
from ...output.sinks.tracker import Escalated, RunEnded, TrackerRun, TrackerSink
from ...records.runs import current_run_id, new_run_id
from ...runtime.exchange_thread import ExchangeThread
from ...system import exit_drain
from ..base import Collector
from ..rank_outlier.statistics import mean_loss
from ..registry import register
from ..replica_check.group import EXCHANGES, exchange, own_group
from .lanes import ALERT_BYTES, LAYOUT, LaneCombiner, LaneReader, RankLanes
from .verdict import RankAlerts, decode

if TYPE_CHECKING:
    from ...anomaly.data_path import PathEvent
    from ...config import MonitorConfig
    from ...records.rows import StepRecord
    from ...runtime.step_context import StepContext

logger = logging.getLogger("msmon")

KEY = "trackers"
FLUSH_SECONDS = 60.0  # when the writer closes, how long to wait for the last gathers


def tracker_formats(cfg: MonitorConfig) -> list[type[TrackerSink]]:
    """The config's tracker formats' sink classes, in its order."""
    known = format_names()
    return [
        sink for sink in (sink_class(name) for name in cfg.format if name in known) if issubclass(sink, TrackerSink)
    ]


@dataclass
class TrackerState:
    """What survives collector rebuilds: the settings read at attach, the group, the thread, the runs."""

    config: MonitorConfig
    formats: list[type[TrackerSink]]
    resolved: bool = False
    off: str | None = None
    group: Any = None
    ranks: list[int] = field(default_factory=list)
    logs: bool = False  # this rank logs the lanes
    script_runs: list[Any] = field(default_factory=list)  # per format: the run the script made, or None
    runs: dict[str, TrackerRun] = field(default_factory=dict)  # format -> its run (the logging rank's)
    failed: set[str] = field(default_factory=set)  # formats switched off
    exchange: ExchangeThread[RankLanes] = field(default_factory=ExchangeThread)
    known: dict[int, float] = field(default_factory=dict)  # group position -> the digest of its names
    names: dict[int, dict[str, list[str]]] = field(default_factory=dict)  # group position -> its names
    combiner: LaneCombiner | None = None
    heard: RankAlerts = field(default_factory=RankAlerts)  # this rank's alerts that may decide the kind
    escalations_put: int = 0  # alert.actions' escalations handed to the exchange thread (the logging rank's)


@register(key=KEY, category="check", order=127, enabled=lambda cfg, ctx: bool(tracker_formats(cfg)))
class TrackerCollector(Collector):
    name = "tracker lanes"

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(ctx)
        state = ctx.kept.get(KEY)
        if state is None:
            state = ctx.kept[KEY] = TrackerState(ctx.config, tracker_formats(ctx.config))
        self.state: TrackerState = state

    def after_update(self) -> None:
        if self.ctx.recording and not self.state.resolved:
            self._resolve()

    # -- setup, once, at the first recorded step, on the training thread ------------------------
    def _resolve(self) -> None:
        state, ctx = self.state, self.ctx
        state.resolved = True
        state.ranks = [ctx.rank]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = list(range(dist.get_world_size()))
            if ctx.config.module_ranks:  # ranks outside module_ranks record nothing: leave them out
                ranks = [r for r in ranks if r in set(ctx.config.module_ranks)]
            if len(ranks) > 1:
                try:
                    state.group = own_group(ranks, KEY)
                    EXCHANGES.append(state)
                except Exception as exc:  # gloo cannot connect: the trackers are off, training goes on
                    state.off = f"creating msmon's gloo group over ranks {ranks} failed: {exc!r}"
                    logger.error("msmon[rank %d]: the tracker formats are off: %s", ctx.rank, state.off)
                    return
                state.ranks = list(dist.get_process_group_ranks(state.group))
        state.logs = ctx.rank == min(state.ranks)
        if state.logs:
            state.script_runs = [fmt.script_run() for fmt in state.formats]
            state.combiner = LaneCombiner(state.ranks)
        columns = CategoryColumns(state.config.category_ops)
        reader = LaneReader(columns, state.config.tracker.tensors, explicit=state.logs)
        thread = f"msmon-trackers-rank{ctx.rank}"
        state.exchange.start(thread, ctx.rank, state, self._gather, "tracker lanes", "gathering")
        ctx.board.listen(state.heard.hear)  # every alert, where alert.actions' vote hears them
        ctx.watch_steps(LaneConsumer(state, reader, ctx.alerts_raised, lambda: ctx.escalations))
        ctx.at_close.append(lambda: close_runs(state, ctx.rank, lambda: ctx.escalations))
        if state.logs:
            logger.info(
                "msmon[rank %d]: the %s lanes of ranks %s are logged from this rank",
                ctx.rank,
                " and ".join(fmt.name for fmt in state.formats),
                state.ranks,
            )

    # -- on this rank's exchange thread ------------------------------------------------------------
    def _run_of(self, fmt: type[TrackerSink], script_run: Any, step: int) -> TrackerRun | None:
        """The format's run, connected the first time it is needed (a failure switches that
        format off, with one line); None once it is off."""
        state = self.state
        if fmt.name in state.failed:
            return None
        run = state.runs.get(fmt.name)
        if run is None:
            try:
                run = state.runs[fmt.name] = fmt.connect(state.config, run_name(state.config), script_run)
            except Exception as exc:
                self._switch_off(fmt.name, step, exc)
        return run

    def _switch_off(self, name: str, step: int, exc: Exception) -> None:
        """One tracker stops, with one line; the gather goes on for the others."""
        self.state.failed.add(name)
        if isinstance(exc, RunEnded):  # the script's run, finished by the script: nothing more to send
            logger.info("msmon[rank %d]: %s; the later steps are in the other formats", self.ctx.rank, exc)
        else:
            logger.error(
                "msmon[rank %d]: the %s format failed at step %d and is switched off: %r",
                self.ctx.rank,
                name,
                step,
                exc,
            )

    def _gather(self, mine: RankLanes) -> None:
        state = self.state
        size = len(state.ranks)
        table = exchange(mine.payload, state.group, size) if state.group is not None else mine.payload[None]
        if bool((table[:, 0] != mine.step).any()):
            raise RuntimeError(f"the ranks' steps do not line up: {dict(zip(state.ranks, table[:, 0].tolist()))}")
        digests = table[:, LAYOUT].tolist()
        if any(state.known.get(i) != d for i, d in enumerate(digests)):  # every rank sees it alike
            state.names = dict(enumerate(self._names(mine.names, size)))
            state.known = dict(enumerate(digests))
        sizes = [int(n) for n in table[:, ALERT_BYTES].tolist()]
        events = self._alerts(mine.alerts, sizes) if any(sizes) else []
        if not state.logs or state.combiner is None:
            return
        names = [state.names[i] for i in range(size)]
        lanes = state.combiner.combine(table, names, mine.tensors, events, mine.escalations)
        for fmt, script_run in zip(state.formats, state.script_runs):  # each connected as its turn comes
            run = self._run_of(fmt, script_run, lanes.step)
            if run is None:
                continue
            try:
                run.send(lanes)
            except Exception as exc:
                self._switch_off(fmt.name, lanes.step, exc)

    def _alerts(self, mine: bytes, sizes: list[int]) -> list[PathEvent]:
        """Every rank's alerts of the step, on the logging rank (one gather to it, of the
        longest rank's bytes); [] on the others."""
        state = self.state
        if state.group is None:
            return decode(mine)
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        if mine:
            padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        parts = [torch.empty_like(padded) for _ in sizes] if state.logs else None
        gather = getattr(dist.gather, "__msmon_original__", dist.gather)
        # the logging rank is the group's first; by its group rank where torch takes one (>= 2.6), so that the
        # gathers of the last steps still run after the script destroyed its process groups, as all_gather does
        root = {"group_dst": 0} if "group_dst" in inspect.signature(gather).parameters else {"dst": min(state.ranks)}
        exit_drain.hold(gather(padded, parts, group=state.group, async_op=True, **root)).wait()
        if parts is None:
            return []
        return [e for part, n in zip(parts, sizes) for e in decode(bytes(part[:n].tolist()))]

    def _names(self, mine: dict[str, list[str]], size: int) -> list[dict[str, list[str]]]:
        """Every rank's tensor names (when one's rows changed): lengths, then the padded bytes."""
        if self.state.group is None:
            return [mine]
        raw = json.dumps(mine).encode()
        lengths = exchange(torch.tensor([float(len(raw))], dtype=torch.float64), self.state.group, size)
        longest = int(lengths.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        rows = exchange(padded, self.state.group, size)
        return [json.loads(bytes(rows[i, : int(n)].tolist())) for i, n in enumerate(lengths[:, 0].tolist())]


def run_name(config: MonitorConfig) -> str:
    """The name of a run msmon makes: tracker.run_name, else the msmon run's id."""
    return config.tracker.run_name or current_run_id() or f"msmon-{new_run_id()}"


def escalated(records: list[dict[str, Any]], start: int) -> list[Escalated]:
    """alert.actions' escalations from the `start`-th on (runtime/actions/escalate.py's records)."""
    return [
        Escalated(n + 1, r["first_step"], r["last_step"], r["alert_step"], r["action"], r["why"], tuple(r["keys"]))
        for n, r in enumerate(records[start:], start)
    ]


def close_runs(state: TrackerState, rank: int, escalations: Callable[[], list[dict[str, Any]]]) -> None:
    """Announce the escalations that started after the last step's lanes (when every gather is
    done), then finish the runs msmon made (the script's are the script's)."""
    late = escalated(escalations(), state.escalations_put) if not state.exchange.pending else []
    for name, run in state.runs.items():
        try:
            if late and name not in state.failed:
                run.escalate(late)
            run.close()
        except Exception as exc:
            logger.warning("msmon[rank %d]: finishing the %s run failed: %r", rank, name, exc)


class LaneConsumer(StepConsumer):
    """On the writer thread: this rank's numbers of each written step, handed to the exchange
    thread (the writer never waits for the other ranks)."""

    name = "tracker lanes"

    def __init__(
        self,
        state: TrackerState,
        reader: LaneReader,
        rank_alerts: Callable[[], int],
        escalations: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self.state = state
        self.reader = reader
        self.rank_alerts = rank_alerts  # this rank's alerts so far
        self.escalations = escalations  # alert.actions' escalations so far (every rank knows them)
        self._alerts_seen = 0

    def consume(self, record: StepRecord, batch: HostRows) -> None:
        state = self.state
        if state.off is not None:
            return
        total = self.rank_alerts()
        alerts, self._alerts_seen = total - self._alerts_seen, total
        mine = self.reader.read(record, mean_loss(batch.keys, batch.values), alerts, state.heard.take())
        if state.logs:
            records = self.escalations()
            mine.escalations = escalated(records, state.escalations_put)
            state.escalations_put = len(records)
        state.exchange.put(mine)

    def writer_closed(self) -> None:
        """Wait (a bounded time) for the gathers of the last steps."""
        left = self.state.exchange.flush(FLUSH_SECONDS)
        if left:
            logger.warning(
                "msmon: %d tracker step(s) still waiting for the other ranks after %.0f s; not logged",
                left,
                FLUSH_SECONDS,
            )

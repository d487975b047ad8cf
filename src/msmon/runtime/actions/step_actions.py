"""The monitor's per-step decision: `alert.on_nan: "stop"` and `alert.actions`, one vote per step.

At the end of step s every monitored rank gives one gather (vote.py) two numbers: whether its
step s held a non-finite statistic (on_nan, read from the step's host copy as before), and how
many bytes of alerts it saw at step s-1; when any rank saw an alert, one more gather carries
them. Every rank reads the same answers and takes the same decision (decide.py): on_nan stops
after step s, the actions of step s-1's alerts are taken at this boundary (stop after step s,
an escalation from step s+1, notifications queued). The alerts are one step behind because
they are made on other threads (the writer, the exchange threads: board.py) while the next
step trains; waiting for them here costs nothing when those threads keep up, which they do
unless the machine's cores are busy (then the training waits for them, at most
alert.vote_timeout). skip_step decides before the optimizer step, from the step's own rows
(skip.py). Everything is fixed when the monitor attaches: every rank must vote at every step.
A vote that fails (a rank died or hangs) is said once and switches the actions off on this rank;
training goes on.
"""

from __future__ import annotations

import logging
import pickle
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

from ...anomaly.seen import Seen
from ...config import MonitorConfig
from ...system.stop import stop_on_nan
from .board import ActionBoard
from .decide import triggers, views
from .escalate import Escalation
from .nonfinite import has_nonfinite
from .notify import Notifications
from .skip import SkipStep
from .stop import ActionStop
from .vote import FINITE, NONFINITE, Round, StepVote, VoteFailed

if TYPE_CHECKING:
    from ..step_context import StepContext
    from ..transfer import HostBatch

logger = logging.getLogger("msmon")


class StepActions:
    """One monitor's vote and actions (module docstring); `close` closes the monitor."""

    def __init__(self, ctx: StepContext, close: Callable[[], None]) -> None:
        config = ctx.config
        self.ctx = ctx
        self._close_monitor = close
        self.on_nan = config.alert.on_nan == "stop"
        self.actions = list(config.alert.actions)
        self.vote = StepVote(config.module_ranks, config.alert.vote_timeout)
        verdicts = any(action.verdicts for action in self.actions)  # a verdict reads every alert of the step
        wanted = None if verdicts else {rule for action in self.actions for rule in action.rules}
        self.board = ActionBoard(active=bool(self.actions), rules=wanted)
        ctx.board = self.board
        does = {action.do for action in self.actions}
        self.escalation = Escalation(speaker=False) if "escalate" in does else None
        if self.escalation is not None:
            ctx.escalations = self.escalation.records  # read by the trackers (collectors/trackers/)
        self.skip = SkipStep(ctx, self.actions, self.vote) if "skip_step" in does else None
        self.notify = Notifications(ctx.rank, speaker=False) if "notify" in does else None
        self.stopper = ActionStop(ctx.rank, ctx.output_base, self.vote) if "stop" in does else None
        self.off: str | None = None
        self.rounds = 0  # summary.json's "vote": what the rounds cost the training thread
        self.round_seconds = 0.0  # in the gathers (waiting for the slowest rank included)
        self.reader_wait_seconds = 0.0  # waiting for this rank's readers of the voted step
        self._host = socket.gethostname()
        self._started = False

    @property
    def enabled(self) -> bool:
        return self.on_nan or bool(self.actions)

    def attach(self, adapter: Any) -> None:
        """At set_monitor: skip_step's hooks (one line where msmon does not own the step); join
        contexts followed (a rank out of inputs answers the rounds from a thread: vote.py)."""
        if self.skip is not None:
            self.skip.install(adapter)
        self.vote.stopping = self._stopping
        self.vote.follow_joins()

    def detach(self) -> None:
        if self.skip is not None:
            self.skip.remove()
        self.vote.stop_listening()

    def _start(self) -> None:
        """At the first vote (torch.distributed is up by then): who speaks for the job."""
        self._started = True
        speaker = self.ctx.rank == self.vote.members()[0]
        if self.escalation is not None:
            self.escalation.speaker = speaker
        if self.notify is not None:
            self.notify = Notifications(self.ctx.rank, speaker)

    # -- before the optimizer step -----------------------------------------------------------------
    def before_update(self) -> None:
        """skip_step's decision for the step now ending (every rank, every step)."""
        if self.skip is None or self.off is not None:
            return
        if not self._started:
            self._start()
        try:
            self.skip.decide()
        except VoteFailed as exc:
            self._failed(exc, f"before step {self.ctx.step}'s update")

    # -- at the end of the step ----------------------------------------------------------------------
    def at_step_end(self, trained: int, batch: HostBatch | None) -> None:
        """After step `trained` on every monitored rank: the vote, then on_nan's stop and the
        actions of step `trained - 1`'s alerts (a stop raises StopRun)."""
        if self.skip is not None:
            self.skip.skipping = False
        if self.off is not None:
            return
        if not self._started:
            self._start()
        try:
            nonfinite = self.on_nan and has_nonfinite(batch, self.ctx.ops_written)
            seen_here = self._seen(trained - 1) if self.actions else []
            payload = pickle.dumps(seen_here) if seen_here else b""
            started = time.perf_counter()
            answered = self.vote.round(NONFINITE if nonfinite else FINITE, payload)
            self.rounds += 1
            self.round_seconds += time.perf_counter() - started
        except VoteFailed as exc:
            self._failed(exc, f"after step {trained}")
            return
        members = self.vote.members()
        with_nonfinite = answered.ranks_in(members, NONFINITE)
        if with_nonfinite:
            stop_on_nan(self.ctx.rank, trained, with_nonfinite, self._close_monitor, self.vote.all_closed)
        stops = []
        for view in views(_unpacked(answered), members):
            for trigger in triggers(self.actions, view):
                do = trigger.action.do
                if do == "notify" and self.notify is not None:
                    self.notify.consider(trigger)
                elif do == "escalate" and self.escalation is not None:
                    self.escalation.consider(trigger)
                elif do == "stop":
                    stops.append(trigger)
        if stops and self.stopper is not None:
            self.stopper.stop(stops[0], trained, self._close_monitor)

    def _stopping(self, answered: Round) -> bool:
        """Whether the ranks still training stop after this round (a rank waiting in a join
        context answers their closing round, then no more: vote.py). Reads, changes nothing."""
        if any(state == NONFINITE for state, _ in answered.answers):
            return True
        members = self.vote.members()
        return any(
            t.action.do == "stop" for view in views(_unpacked(answered), members) for t in triggers(self.actions, view)
        )

    def _seen(self, step: int) -> list[Seen]:
        """What this rank saw up to `step`, once its readers finished it (a bounded wait). A
        reader that is late once is not waited for again: its alerts join the vote of a later
        step (every rank still reads the same ones), and a stuck reader never slows every step."""
        started = time.perf_counter()
        late = self.board.wait_finished(step, self.vote.timeout.total_seconds())
        self.reader_wait_seconds += time.perf_counter() - started
        for source in late:
            self.board.retire(source)
            logger.warning(
                "msmon[rank %d]: the %s had not read step %d after %g s (alert.vote_timeout); it is not waited for "
                "any more: its alerts join the vote of a later step",
                self.ctx.rank,
                source.replace("_", " "),
                step,
                self.vote.timeout.total_seconds(),
            )
        return [one.on_host(self._host) for one in self.board.take(step)]

    def config_switch(self, next_step: int, agreed: MonitorConfig | None) -> MonitorConfig | None:
        """The config to put in force at this boundary: an escalation's start or end, else the
        edit the ranks agreed on (`agreed`), else None."""
        if self.escalation is None:  # without a vote (off) none starts, and the one in force still ends
            return agreed
        return self.escalation.at_boundary(next_step, self.ctx.config, agreed)

    def _failed(self, exc: BaseException, when: str) -> None:
        self.off = f"{when}: {exc}"
        self.board.active = False
        logger.error(
            "msmon[rank %d]: %s; alert.actions and on_nan are off on this rank, training goes on",
            self.ctx.rank,
            str(exc).replace("the vote ", f"the vote {when} ", 1)
            if str(exc).startswith("the vote ")
            else f"{when}: {exc}",
        )

    # -- the end of the run ----------------------------------------------------------------------------
    def close(self) -> None:
        """At the monitor's close: the notifications still queued get a bounded wait."""
        if self.notify is not None:
            self.notify.close()

    def summary(self, last_trained: int | None) -> dict[str, Any]:
        """What the actions did, for summary.json."""
        out: dict[str, Any] = {
            "vote": {
                "rounds": self.rounds,
                "round_seconds": round(self.round_seconds, 6),
                "reader_wait_seconds": round(self.reader_wait_seconds, 6),
            }
        }
        if self.escalation is not None:
            out["escalations"] = self.escalation.summary(last_trained)
        if self.skip is not None:
            out["skipped_steps"] = list(self.skip.skipped)
            out["skips"] = len(self.skip.skipped)
        if self.notify is not None:
            delivery = self.notify.delivery
            if delivery is not None:
                out["notify"] = {
                    "sent": delivery.sent,
                    "failed": delivery.failed,
                    "dropped": delivery.dropped,
                    "close_seconds": delivery.close_seconds,
                }
                if delivery.errors:
                    out["notify"]["errors"] = delivery.errors
        if self.off is not None:
            out["actions_off"] = self.off
        return out


def _unpacked(answered: Round) -> list[Seen]:
    """Every rank's alerts of a round."""
    return [one for payload in answered.payloads if payload for one in pickle.loads(payload)]

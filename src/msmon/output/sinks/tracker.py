"""What the tracker formats (wandb_sink.py, mlflow_sink.py) share: they send lanes, not tensors.

A tracker cannot take one series per tensor and rank (W&B advises under 10,000 metrics per
project; MLflow takes 1,000 metrics and 1 MB per batch). So a tracker sink writes nothing per
rank: `write` does nothing. Every recorded step, each rank's lane values are gathered on one
rank, the lowest recording rank (global rank 0 as a rule), by collectors/trackers/, which hands
the step's `StepLanes` to the `TrackerRun` each tracker format connects there: per category and
op the max and the median over tensors and the rank and tensor holding the max, the loss per
rank as min/median/max, the alert counts and the verdict, and the explicit tensors the config
names. The verdict is the kind of fault once one is told (anomaly/fault_kind.py, from every
rank's alerts so far, as `msmon analyse` tells it), else the step's level (ok, alert,
nonfinite); a kind told or changed, a level first reached and an escalation of alert.actions are
announced (a W&B alert, MLflow tags: each run's `_told`, `_rose`, `_escalated`). A run is the
script's when it made one (never finished by msmon), else one msmon makes, named after the msmon
run, and finishes at the end. Keys follow the tracker's naming rules
(`valid`, collisions kept apart) and stop at `tracker.max_keys`, said once. The client package
(`REQUIRES` in the sink file) is imported only on the logging rank, off the training thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from ...anomaly.fault_kind import KINDS, FaultKind
from ...records.rows import StepRecord
from .base import Sink

if TYPE_CHECKING:
    from ...config import MonitorConfig

logger = logging.getLogger("msmon")

VERDICTS = ("ok", "alert", "nonfinite")  # the step's level, rising (`msmon/verdict` is its index)
STEP_KEY = "msmon/step"  # the trackers' own step axis: never the script's step counter
Value = Union[float, str]  # a number, or a text (the tensor holding a max)


class RunEnded(Exception):
    """The script finished its run: msmon sends nothing more to it (the other formats keep the steps)."""


@dataclass(frozen=True)
class Escalated:
    """An escalation of alert.actions (runtime/actions/escalate.py's record): the `number`-th of
    the run, steps `first_step` to `last_step`, for the alerts of `alert_step`."""

    number: int
    first_step: int
    last_step: int
    alert_step: int
    action: int  # its place in alert.actions
    why: str
    keys: tuple[str, ...]

    def title(self) -> str:
        return f"msmon: escalation of steps {self.first_step} to {self.last_step}"

    def text(self) -> str:
        return (
            f"steps {self.first_step} to {self.last_step} record also {', '.join(self.keys)} (alert.actions"
            f"[{self.action}], on the alerts of step {self.alert_step}): {self.why}"
        )


@dataclass
class StepLanes:
    """One recorded step as the trackers get it: generic keys (`msmon/...`), in the order they
    are admitted under the key budget, and what to announce."""

    step: int
    values: dict[str, Value] = field(default_factory=dict)
    verdict: str = "ok"  # the kind's code once one is told, else the step's level (VERDICTS)
    level: str = "ok"  # the step's level
    rise: str | None = None  # set at the step the level first rises to a level: what happened
    kind: FaultKind | None = None  # the kind told so far
    told: bool = False  # the kind was told, or changed, at this step
    escalations: list[Escalated] = field(default_factory=list)  # escalations that started since the last step


def verdict_text(kind: FaultKind | None, level: str) -> str:
    """The verdict in words: the kind's code and headline once told, else the level."""
    return f"{kind.code}: {kind.headline()}" if kind is not None else level


def kind_text(kind: FaultKind) -> str:
    """What a told kind announces: the kind, why, and what to do."""
    return f"{kind.code}: {kind.why}. What to do: {KINDS[kind.code].action}."


class TrackerSink(Sink):
    """A tracker format's sink: nothing per rank; `script_run` and `connect` for the logging rank."""

    @classmethod
    def for_rank(cls, log_dir: str, config: MonitorConfig) -> TrackerSink:
        return cls()

    def write(self, record: StepRecord) -> None:
        """Nothing: the tracker gets the lanes gathered across the ranks (collectors/trackers/)."""

    @classmethod
    def script_run(cls) -> Any:
        """The run the script made, read on the training thread; None when it made none (or never
        imported the client: then it cannot have)."""
        raise NotImplementedError

    @classmethod
    def connect(cls, config: MonitorConfig, run_name: str, script_run: Any) -> TrackerRun:
        """The run to log into (on the logging rank's exchange thread): `script_run`, or a new one."""
        raise NotImplementedError


class TrackerRun:
    """One tracker run msmon logs into, from one thread: names made valid, the key budget kept."""

    tracker = "tracker"
    case_blind = False  # whether the tracker takes two names differing in case for one

    def __init__(self, own: bool, max_keys: int) -> None:
        self.own = own  # msmon made it: msmon finishes it
        self.max_keys = max_keys
        self._names: dict[str, str] = {}  # generic key -> the tracker's name
        self._taken: set[str] = set()
        self.dropped = 0  # keys over the budget, not sent
        self.closed = False

    def valid(self, key: str) -> str:
        """`key` as a name the tracker takes."""
        raise NotImplementedError

    def _log(self, step: int, values: dict[str, Value]) -> None:
        raise NotImplementedError

    def _rose(self, step: int, level: str, text: str) -> None:
        """The step's level rose to `level` for the first time: `text` says what happened."""
        raise NotImplementedError

    def _told(self, step: int, kind: FaultKind, level: str, rise: str | None) -> None:
        """A kind of fault told, or changed, at `step`; `rise`: what happened where the step's
        `level` first rose at the same step, else None."""
        raise NotImplementedError

    def _escalated(self, escalation: Escalated) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def name_of(self, key: str) -> str | None:
        """The tracker's name for a generic key, or None when the budget is full (said once)."""
        name = self._names.get(key)
        if name is not None:
            return name
        if len(self._names) >= self.max_keys:
            return None
        base = name = self.valid(key)
        n = 1
        while (name.casefold() if self.case_blind else name) in self._taken:
            n += 1
            name = f"{base}_{n}"
        self._taken.add(name.casefold() if self.case_blind else name)
        self._names[key] = name
        return name

    def send(self, lanes: StepLanes) -> None:
        values: dict[str, Value] = {}
        over = []
        for key, value in lanes.values.items():
            name = self.name_of(key)
            if name is None:
                over.append(key)
            else:
                values[name] = value
        if over and not self.dropped:
            logger.warning(
                "msmon: the %s run's key budget (tracker.max_keys = %d) is full at step %d: %d keys are not sent, "
                "from %s on; the other formats keep every value (said once)",
                self.tracker,
                self.max_keys,
                lanes.step,
                len(over),
                over[0],
            )
        self.dropped += len(over)
        self._log(lanes.step, values)
        if lanes.told and lanes.kind is not None:
            self._told(lanes.step, lanes.kind, lanes.level, lanes.rise)
        elif lanes.rise:
            self._rose(lanes.step, lanes.level, lanes.rise)
        self.escalate(lanes.escalations)

    def escalate(self, escalations: list[Escalated]) -> None:
        """Announce escalations of alert.actions (with a step's lanes, or the last ones at the close)."""
        for escalation in escalations:
            self._escalated(escalation)

    def close(self) -> None:
        """Finish the run if msmon made it; a script's run is the script's to finish."""
        if not self.closed:
            self.closed = True
            if self.own:
                self._finish()

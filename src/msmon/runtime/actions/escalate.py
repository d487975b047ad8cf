"""`{"do": "escalate", "for_steps": N, "config": {...}}`: record more for N steps, on every rank.

The vote decides at a step boundary, the same on every rank, that an escalation starts; from
the next step on every rank records the base config plus the action's keys (config/actions.py's
`escalated`), for N steps, then returns to the base config. The switch is the config reload's
own (step.py's `apply_config`: collectors rebuilt between two steps), taken at the same
boundary on every rank because the vote is. An edit of the config file agreed meanwhile
becomes the new base, the escalation's keys still on top.

When it fires: on an alert of a rule and tensor (or a verdict and its ranks) the action has not
escalated for yet, while no escalation is in force: a fault that alerts at every step
escalates once, a new one again. The escalations are kept for summary.json (`escalations`:
first and last step, the action, why, the keys), which `msmon db` and the report read.
"""

from __future__ import annotations

import logging
from typing import Any

from ...config import MonitorConfig, parse_config
from ...config.actions import escalated
from .decide import Trigger

logger = logging.getLogger("msmon")


def _pairs(trigger: Trigger) -> set[tuple[Any, ...]]:
    pairs: set[tuple[Any, ...]] = {(s.rule, *s.tensor) for s in trigger.matched}
    if trigger.verdict and trigger.kind is not None:
        pairs.add(("verdict", trigger.kind.code, tuple(trigger.ranks)))
    return pairs


class Escalation:
    """The escalation in force (at most one), the base config under it, and those of the run."""

    def __init__(self, speaker: bool) -> None:
        self.speaker = speaker  # the lowest voting rank says what happens, once for the job
        self.base: MonitorConfig | None = None  # the config under the escalation in force
        self.current: dict[str, Any] | None = None  # the record of the escalation in force
        self._starting: tuple[Trigger, dict[str, Any]] | None = None
        self._acted: dict[int, set[tuple[Any, ...]]] = {}  # per action: what it escalated for
        self.records: list[dict[str, Any]] = []

    def consider(self, trigger: Trigger) -> None:
        """An escalate action the step's alerts call for; starts at the next boundary when new."""
        acted = self._acted.setdefault(trigger.index, set())
        pairs = _pairs(trigger)
        fresh = pairs - acted
        acted |= pairs
        if not fresh or self.current is not None or self._starting is not None:
            return
        action = trigger.action
        record = {
            "first_step": None,
            "last_step": None,
            "action": trigger.index,
            "alert_step": trigger.step,
            "why": trigger.why(),
            "keys": sorted(action.config),
            "_overlay": action.config,
        }
        self._starting = (trigger, record)

    def at_boundary(self, next_step: int, current: MonitorConfig, agreed: MonitorConfig | None) -> MonitorConfig | None:
        """The config to put in force for `next_step` (None: keep the one in force). `agreed`:
        an edit of the config file the ranks agreed on at this boundary."""
        if self.current is not None and next_step > self.current["last_step"]:
            base = agreed or self.base or current
            self._say("ends", self.current, next_step)
            self.current, self.base = None, None
            if self._starting is None:
                return base
            current = base
        if self._starting is not None:
            trigger, record = self._starting
            self._starting = None
            self.base = agreed or current
            record["first_step"] = next_step
            record["last_step"] = next_step + trigger.action.for_steps - 1
            self.current = record
            self.records.append(record)
            self._say("starts", record, next_step)
            return escalated(self.base, trigger.action.config, parse_config)
        if self.current is not None and agreed is not None:  # the new base, the escalation's keys on top
            self.base = agreed
            return escalated(agreed, self.current["_overlay"], parse_config)
        return agreed

    def summary(self, last_trained: int | None) -> list[dict[str, Any]]:
        """The run's escalations; one still in force when the run ended ends at its last step."""
        out = []
        for record in self.records:
            row = {k: v for k, v in record.items() if not k.startswith("_")}
            if last_trained is not None and row["last_step"] is not None and row["last_step"] > last_trained:
                row["last_step"] = max(last_trained, row["first_step"] - 1)
                row["cut_short"] = True
            out.append(row)
        return out

    def _say(self, what: str, record: dict[str, Any], step: int) -> None:
        if not self.speaker:
            return
        if what == "starts":
            logger.warning(
                "msmon: escalation from step %d to %d on every rank (alert.actions[%d]: %s), recording also %s",
                record["first_step"],
                record["last_step"],
                record["action"],
                record["why"],
                ", ".join(record["keys"]),
            )
        else:
            logger.info(
                "msmon: the escalation of steps %d to %d ends; step %d records the base config",
                record["first_step"],
                record["last_step"],
                step,
            )

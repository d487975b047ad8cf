"""`{"do": "notify", "on": [...], "url": ... | "command": [...]}`: one message per rule and tensor.

Decided by the vote like every action, so the lowest voting rank sends for the job: one message
the first time a rule alerts on a tensor (on any rank: the message lists the ranks that alerted
on it at that step), later alerts of the same rule on the same tensor are not sent again, as
the log says them once (output/repeats.py); a verdict is sent once per kind and ranks. Delivery
is output/notify.py's thread: the training thread only queues.
"""

from __future__ import annotations

from typing import Any

from ...anomaly.seen import Seen
from ...output.notify import CLOSE_SECONDS, Delivery, Notifier, Target
from ...records.runs import current_run_id
from .decide import Trigger


def _list(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:16]) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def alert_message(step: int, rule: str, seen: list[Seen]) -> dict[str, Any]:
    """The message of one rule's alerts on one tensor at one step (`seen`: every rank's)."""
    first = seen[0]
    ranks = sorted({s.rank for s in seen})
    text = (
        f"msmon alert at step {step}: {rule} on the {first.what()} on rank{'s' if len(ranks) > 1 else ''} "
        f"{_list(ranks)}: {first.message}"
    )
    return {
        "text": text,
        "kind": "alert",
        "step": step,
        "rule": rule,
        "category": first.category,
        "tensor": first.name,
        "vpp_stage": first.vpp_stage,
        "ranks": ranks,
        "hosts": sorted({s.host for s in seen if s.host}),
        "op": first.op,
        "value": first.value,
        "message": first.message,
        "run_id": current_run_id(),
    }


def verdict_message(trigger: Trigger) -> dict[str, Any]:
    kind = trigger.kind
    assert kind is not None
    return {
        "text": f"msmon verdict at step {trigger.step}: {kind.headline()}. {kind.sentence()}",
        "kind": "verdict",
        "step": trigger.step,
        "verdict": kind.code,
        "ranks": trigger.ranks,
        "hosts": trigger.view.hosts(trigger.ranks),
        "module": kind.module,
        "tensor": kind.tensor,
        "message": kind.why,
        "run_id": current_run_id(),
    }


class Notifications:
    """The notify actions of one monitor: what was sent already, the sender (lowest rank only)."""

    def __init__(self, rank: int, speaker: bool) -> None:
        self.notifier = Notifier(rank) if speaker else None
        self._closed: Delivery | None = None
        self._told: dict[int, set[tuple[Any, ...]]] = {}

    def consider(self, trigger: Trigger) -> None:
        """Send what `trigger` (a notify action's) says that was not said before."""
        told = self._told.setdefault(trigger.index, set())
        action = trigger.action
        target = Target(action.url, tuple(action.command), action.timeout, action.retries)
        messages = []
        by_tensor: dict[tuple[Any, ...], list[Seen]] = {}
        for one in trigger.matched:
            by_tensor.setdefault((one.rule, *one.tensor), []).append(one)
        for key, alerts in by_tensor.items():
            if key not in told:
                told.add(key)
                messages.append(alert_message(trigger.step, key[0], alerts))
        if trigger.verdict and trigger.kind is not None:
            key = ("verdict", trigger.kind.code, tuple(trigger.ranks))
            if key not in told:
                told.add(key)
                messages.append(verdict_message(trigger))
        if self.notifier is not None:
            for message in messages:
                self.notifier.send(target, message)

    def close(self, seconds: float = CLOSE_SECONDS) -> None:
        """At the monitor's close: wait a bounded time for what is queued (once)."""
        if self.notifier is not None and self._closed is None:
            self._closed = self.notifier.close(seconds)

    @property
    def delivery(self) -> Delivery | None:
        """What happened to the messages so far (None on a rank that sends none)."""
        return self.notifier.delivery if self.notifier is not None else None

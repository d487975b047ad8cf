"""`{"do": "stop", "on": [...]}`: every rank stops at the same step boundary, with an exit code
chosen by the kind of fault, so that a scheduler can act on it (docs/actions.md has the table):

    16  one rank's device or model copy is suspected: restart the job elsewhere
        (one_rank_model_copy, one_rank_data_or_device; some_ranks when they share one host)
    17  every rank, or the data: do not restart blindly (all_ranks, one_rank_data,
        reduction_or_optimizer, some_ranks on several hosts, no kind told)

The incident ledger (records/incidents.py, in the output root) keeps every such stop; when the
same verdict at the same step is in it `repeat_limit - 1` times already, a restart met the
same fault again: the stop exits 17, and its line says why. The ledger is read when the monitor
attaches (before this run wrote to it); where nodes do not share the output root and their
ranks read different ledgers, `msmon run` takes the highest code any rank recorded (17 over 16:
system/decision.py), so the job exits 17 as soon as one of them knows the fault came back.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Callable

from ...records.incidents import append_incident, occurrences, read_incidents
from ...records.runs import current_run_id
from ...system.decision import Decision, record
from ...system.exit_codes import JOB_FAULT_STOP, RANK_FAULT_STOP
from ...system.stop import StopOnAction
from .decide import Trigger
from .vote import StepVote

logger = logging.getLogger("msmon")

RANK_FAULT_KINDS = ("one_rank_model_copy", "one_rank_data_or_device")


def code_for(trigger: Trigger) -> tuple[int, str]:
    """The exit code the step's kind of fault calls for, and the kind in words."""
    kind = trigger.kind
    if kind is None:
        return JOB_FAULT_STOP, "no kind of fault told (one rank alone, or no rank-local value)"
    words = kind.headline()
    if kind.code in RANK_FAULT_KINDS:
        return RANK_FAULT_STOP, words
    if kind.code == "some_ranks" and len(trigger.view.hosts(kind.ranks)) == 1:
        return RANK_FAULT_STOP, f"{words}, all on host {trigger.view.hosts(kind.ranks)[0]}"
    return JOB_FAULT_STOP, words


class ActionStop:
    """The stop actions of one monitor: the ledger as it was at attach, the stop itself."""

    def __init__(self, rank: int, output_base: str, vote: StepVote) -> None:
        self.rank = rank
        self.output_base = output_base
        self.vote = vote
        self.earlier = read_incidents(output_base)  # before this run wrote to it

    def stop(self, trigger: Trigger, trained: int, close: Callable[[], None]) -> None:
        """Close the monitor, record the decision for the launcher (system/decision.py: `msmon run`
        prints its line once and returns its code), wait for the other ranks to have closed
        theirs, stop the process with the code (raises StopOnAction). Without `msmon run` each
        rank says the line itself."""
        code, words = code_for(trigger)
        verdict = trigger.kind.code if trigger.kind is not None else None
        seen_before = occurrences(self.earlier, verdict, trigger.step)
        if trigger.verdict:
            reason = f"{words} [verdict {verdict}]"
        else:
            reason = f"{trigger.why()} at step {trigger.step}" + (
                f"; kind: {words} [verdict {verdict}]" if verdict else ""
            )
        if code == RANK_FAULT_STOP and seen_before + 1 >= trigger.action.repeat_limit:
            code = JOB_FAULT_STOP
            reason = (
                f"the same fault ({verdict} at step {trigger.step}) is in the incident ledger {seen_before} time"
                f"{'s' if seen_before > 1 else ''} already (incidents.jsonl): a restart met it again, so it is not "
                f"that device; {reason}"
            )
        if self.rank == self.vote.members()[0]:
            self._write(trigger, code, verdict, reason)
        advice = "restart it elsewhere" if code == RANK_FAULT_STOP else "do not restart it blindly"
        line = (
            f"msmon: the job stopped after step {trained} as alert.actions[{trigger.index}] asks (exit code {code}: "
            f"{advice}): {reason}"
        )
        close()
        recorded = record(Decision(code, line, trained, self.rank, trigger.ranks))
        self.vote.all_closed()
        if recorded is None:
            print(line.replace("msmon:", f"msmon[rank {self.rank}]:", 1), flush=True)
        raise StopOnAction(code)

    def _write(self, trigger: Trigger, code: int, verdict: str | None, reason: str) -> None:
        incident: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "run_id": current_run_id(),
            "step": trigger.step,
            "verdict": verdict,
            "ranks": trigger.ranks,
            "hosts": trigger.view.hosts(trigger.ranks) or [socket.gethostname()],
            "code": code,
            "action": trigger.index,
            "why": reason,
        }
        try:
            append_incident(self.output_base, incident)
        except OSError as exc:
            logger.error("msmon: writing the incident ledger in %s failed: %s", self.output_base, exc)

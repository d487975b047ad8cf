"""The anomaly pipeline of a written step: alert rules, the NaN origin, alert lines, the dump.

A consumer of the writer (output.handoff): the rank output hands it to the writer, which gives
it every step after the sinks, on the writer thread, so rule evaluation costs the training thread
nothing. The counts (alerts raised, the first non-finite origin) go to summary.json.

After a NaN, every later step alerts again on the same tensors; a line per step and tensor would
bury the first one. So a rule alerting on a tensor is logged once, the first time; its repeats are
counted (repeats.py, shared with the rank-outlier rule and the replica check), and when the
monitor closes one line per rule and tensor gives the count and the steps. The dump keeps every
alert.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

from ..anomaly.dump import AnomalyDumpWriter
from ..anomaly.origin import Origin, find_origin
from ..anomaly.rules import Alert, RuleEngine
from ..anomaly.seen import Seen, from_alert
from ..records.rows import RowKey, StepRecord
from .handoff import HostRows, StepConsumer
from .repeats import AlertRepeats
from .sinks.base import naming

logger = logging.getLogger("msmon")


def _tensor(alert: Alert) -> tuple:
    """(rule, tensor): micro-steps and ops of one tensor share one line."""
    key = alert.key
    return alert.rule, key.category, key.name, key.vpp_stage, key.train_stage


class AlertConsumer(StepConsumer):
    """Scans each step with the rules, names the first non-finite value (nan_origin), logs up to
    `lines_per_step` alerts and appends them all to the anomaly dump, once one is set."""

    name = "alerts"

    def __init__(
        self,
        rank: int,
        rules: RuleEngine | None,
        lines_per_step: int = 10,
        repeats: AlertRepeats | None = None,
        seen: Callable[[list[Seen]], None] | None = None,
    ) -> None:
        self.rank = rank
        self.seen = seen  # alert.actions: the step's alerts, for the ranks' vote (runtime/actions/)
        self.rules = rules
        self.lines_per_step = lines_per_step
        self.dump: AnomalyDumpWriter | None = None
        self.alerts_raised = 0
        self.first_origin: dict | None = None
        # (rule, tensor) -> its alerts so far: the monitor's, kept across writer restarts, said at its close
        self.repeats = repeats if repeats is not None else AlertRepeats(rank)

    def continue_from(self, previous: AlertConsumer) -> None:
        """Carry on the counts of the pipeline this one replaces (an edit of the output settings
        restarts the writer; summary.json counts the whole run)."""
        self.alerts_raised, self.first_origin = previous.alerts_raised, previous.first_origin

    def consume(self, record: StepRecord, batch: HostRows) -> None:
        alerts = self.rules.scan(record.keys, record.ops, None, record.table) if self.rules is not None else []
        origin = find_origin(batch.flag_keys, batch.finite_flags()) if batch.flag_keys else None
        if origin is not None:
            alerts.insert(0, self._origin_alert(record, origin))
        if alerts:
            self._report(record, alerts)
            if self.seen is not None:
                self.seen([from_alert(self.rank, record.step, alert) for alert in alerts])

    def output_stopped(self) -> None:
        self.dump = None

    def _origin_alert(self, record: StepRecord, origin: Origin) -> Alert:
        message = f"first non-finite value: {origin.describe()}, all that fed it was finite"
        if self.first_origin is None:
            logger.warning("msmon[rank %d] step %d: %s", self.rank, record.step, message)
            self.first_origin = {
                "step": record.step,
                "rank": self.rank,
                "stage": origin.stage,
                "module": origin.module,
                "tensor": origin.tensor,
                "micro_step": origin.micro_step,
                "vpp_stage": origin.vpp_stage,
            }
        category = origin.category or ("actv" if origin.stage == "forward" else "actv_grad")
        key = RowKey(category, origin.tensor, origin.vpp_stage, origin.micro_step, origin.stage)
        op, value = _first_nonfinite(record, key)
        return Alert(key, origin.call_id, op, value, None, "NanOrigin", message)

    def _new(self, step: int, alerts: list[Alert]) -> list[Alert]:
        """The alerts of a rule on a tensor not alerted before (the others are counted)."""
        return [a for a in alerts if self.repeats.first(_tensor(a), a.rule, a.key.tag(self.rank), step)]

    def _report(self, record: StepRecord, alerts: list[Alert]) -> None:
        self.alerts_raised += len(alerts)
        shown = self._new(record.step, alerts)
        for alert in shown[: self.lines_per_step]:
            history = "none" if alert.history is None else f"{alert.history:.6g}"
            logger.warning(
                "msmon alert [rank %d] step %d micro-step %s %s %s=%.6g history=%s (%s): %s",
                self.rank,
                record.step,
                alert.key.micro_step if alert.key.micro_step is not None else "-",
                alert.key.tag(self.rank),
                alert.op,
                alert.value,
                history,
                alert.rule,
                alert.message,
            )
        if len(shown) > self.lines_per_step:
            logger.warning(
                "msmon alert [rank %d] step %d: %d more alerts not shown (see the anomaly dump)",
                self.rank,
                record.step,
                len(shown) - self.lines_per_step,
            )
        if self.dump is not None:
            try:
                self.dump.write(record, alerts)
            except OSError as exc:  # the writer stops the rank's output, naming the dump
                raise naming(exc, self.dump.path)


def _first_nonfinite(record: StepRecord, key: RowKey) -> tuple[str, float]:
    """The origin tensor's first non-finite statistic in its row of the step (`norm`, inf for an
    Inf), so the dump says which value it was; ("nonfinite", nan) when the tensor has no row
    (its finiteness flag alone says it was NaN or Inf, not which)."""
    for i, row_key in enumerate(record.keys):
        same = (row_key.category, row_key.name, row_key.vpp_stage, row_key.micro_step) == (
            key.category,
            key.name,
            key.vpp_stage,
            key.micro_step,
        )
        if same and row_key.op is None:
            row = record.table[i].tolist() if record.table is not None else record.values[i]
            for op, value in zip(record.ops, row):
                if not math.isfinite(value):
                    return op, value
    return "nonfinite", math.nan

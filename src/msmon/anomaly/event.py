"""The anomaly record, declared once: what a line of `anomaly.jsonl` holds.

The dump writes these fields in this order, `msmon analyse` reads them back, and `msmon db`
keeps them as the columns of its `anomalies` table (with the SQL type given here). Torch-free:
the offline readers import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..records.rows import BACKWARD, FORWARD, OPTIMIZER

NAN_ORIGIN_RULE = "NanOrigin"  # records written by the first-non-finite-origin detector
REPLICA_RULE = "ReplicaMismatch"  # records of the replica check (collectors/replica_check.py)
REPLICA_OP = "replica_mismatch"
RANK_OUTLIER_RULE = "AnomalyRankOutlier"  # a rank whose rank-local statistics leave the ranks' spread
STAGES = (FORWARD, BACKWARD, OPTIMIZER)


@dataclass(frozen=True)
class EventField:
    """One field of an anomaly record: its JSON key and the column type `msmon db` gives it."""

    name: str
    sql_type: str
    meaning: str


EVENT_FIELDS = (
    EventField("rank", "INTEGER", "the global rank that recorded it"),
    EventField("step", "BIGINT", "the training step"),
    EventField("micro_step", "INTEGER", "the micro-step; null for a statistic of the whole step"),
    EventField("pp_stage", "INTEGER", "the pipeline stage of the rank"),
    EventField("vpp_stage", "INTEGER", "the virtual pipeline chunk of the tensor"),
    EventField("stage", "VARCHAR", "forward, backward or optimizer"),
    EventField("call_id", "INTEGER", "the row's order within the rank's step"),
    EventField("tag", "VARCHAR", "the metric tag, as TensorBoard shows it"),
    EventField("name", "VARCHAR", "the tensor's name"),
    EventField("category", "VARCHAR", "the tensor's category (CSV file prefix)"),
    EventField("op", "VARCHAR", "the statistic that alerted"),
    EventField("value", "DOUBLE", 'its value ("nan", "inf", "-inf" as strings in JSON)'),
    EventField("history", "DOUBLE", "the value the rule compared it to, if any"),
    EventField(
        "rule", "VARCHAR", "the rule: AnomalyNan, AnomalyTurbulence, AnomalyRankOutlier, NanOrigin, ReplicaMismatch"
    ),
    EventField("message", "VARCHAR", "the alert in words"),
    EventField("group_mates", "INTEGER[]", "the global ranks of the rank's pipeline group"),
)
FIELDS = tuple(f.name for f in EVENT_FIELDS)


def json_number(value: float | None) -> float | str | None:
    """A float as strict JSON allows: NaN and infinities become strings."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value

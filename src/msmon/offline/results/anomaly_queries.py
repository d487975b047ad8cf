"""The report's anomaly section: the anomalies table read back as `msmon analyse`'s events, its
verdict, the first anomalies and a bounded timeline across ranks, and each monitor's own first
non-finite origin."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ...anomaly.event import FIELDS, NAN_ORIGIN_RULE
from ...records.rows import BACKWARD, FORWARD, OPTIMIZER
from ..analyse.events import AnomalyEvent
from ..analyse.kind import fault_kind
from ..analyse.verdict import first_per_rank, verdict
from .limits import Limits

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection


_EVENT_FIELDS = (*FIELDS, "file")  # the anomaly record's fields, and the dump it came from


def anomaly_events(con: DuckDBPyConnection) -> list[AnomalyEvent]:
    """The anomalies table as msmon analyse's events, in training order."""
    rows = con.execute(f"SELECT {', '.join(_EVENT_FIELDS)} FROM anomalies ORDER BY seq").fetchall()
    events = []
    for row in rows:
        fields = dict(zip(_EVENT_FIELDS, row))
        fields["group_mates"] = list(fields["group_mates"] or [])
        fields["message"] = fields["message"] or ""
        fields["tag"] = fields["tag"] or ""
        fields["rule"] = fields["rule"] or ""
        fields["file"] = fields["file"] or ""
        events.append(AnomalyEvent(**fields))
    return events


def job_ranks(con: DuckDBPyConnection) -> set[int]:
    """Every rank that wrote output to the database: the job's ranks, for the verdict's kind."""
    return {r[0] for r in con.execute("SELECT DISTINCT rank FROM files WHERE rank IS NOT NULL").fetchall()}


def _kind_json(ordered: list[AnomalyEvent], ranks: set[int]) -> dict[str, Any] | None:
    """The kind of fault `msmon analyse` tells for the first anomaly (anomaly/fault_kind.py: "one
    rank: its data or its device", "all ranks together", ...: its `kind` in msmon_analyse.json), or None
    when it tells none. The page shows it in words at the top (static/charts.js, verdictBox)."""
    kind = fault_kind(ordered, ranks)
    return None if kind is None else dict(kind.to_json())


def anomalies(con: DuckDBPyConnection, limits: Limits) -> dict[str, Any]:
    """The verdict of `msmon analyse` and its kind, the first anomalies, and a bounded timeline
    across ranks."""
    ordered = anomaly_events(con)
    if not ordered:
        return {
            "total": 0,
            "verdict": verdict([]),
            "kind": None,
            "first": [],
            "points": [],
            "rules": [],
            "sampled": False,
            "origin": None,
            "first_per_rank": 0,
            "ranks": 0,
        }
    ranks = job_ranks(con)
    rules = sorted({e.rule or "?" for e in ordered})
    budget = limits.timeline_points
    if len(ordered) <= budget:
        shown = list(range(len(ordered)))
    else:  # the first half of the budget in order, the rest evenly over what follows
        head = budget // 2
        rest = len(ordered) - head
        shown = list(range(head)) + [head + (i * rest) // (budget - head) for i in range(budget - head)]
    stage_offset = {FORWARD: 0.15, BACKWARD: 0.45, OPTIMIZER: 0.75}
    tensors: dict[str, int] = {}
    stages = list(stage_offset)
    points = []  # [x, rank, rule, seq, tensor, stage, micro_step]: the tooltip is built from them
    for i in shown:
        e = ordered[i]
        what = tensors.setdefault(e.what(), len(tensors))
        points.append(
            [
                e.step + stage_offset.get(e.stage, 0.9),
                e.rank,
                rules.index(e.rule or "?"),
                i,
                what,
                stages.index(e.stage) if e.stage in stages else -1,
                e.micro_step,
            ]
        )
    origin = next((e for e in ordered if e.rule == NAN_ORIGIN_RULE), None)
    firsts = first_per_rank(ordered)
    return {
        "total": len(ordered),
        "verdict": verdict(ordered, ranks),
        "kind": _kind_json(ordered, ranks),
        "rules": rules,
        "points": points,
        "sampled": len(shown) < len(ordered),
        "shown": len(shown),
        "first": [_event_json(i, e) for i, e in enumerate(ordered[: limits.first_anomalies])],
        "origin": _event_json(ordered.index(origin), origin) if origin else None,
        "ranks": len(firsts),
        "first_per_rank": len(firsts),
        "tensors": list(tensors),
        "stages": stages,
    }


def _event_json(seq: int, e: AnomalyEvent) -> dict[str, Any]:
    js = e.to_json()
    return {
        "seq": seq,
        "rank": e.rank,
        "step": e.step,
        "micro_step": e.micro_step,
        "stage": e.stage,
        "pp_stage": e.pp_stage,
        "vpp_stage": e.vpp_stage,
        "rule": e.rule,
        "name": e.name,
        "category": e.category,
        "op": e.op,
        "value": js["value"],
        "history": js["history"],
        "description": js["description"],
    }


def first_nonfinite(con: DuckDBPyConnection) -> list[dict[str, Any]]:
    """Each monitor's own first non-finite origin (summary.json), earliest first."""
    rows = con.execute(
        "SELECT rank, first_nonfinite FROM summaries WHERE first_nonfinite IS NOT NULL "
        "AND first_nonfinite <> 'null' ORDER BY rank"
    ).fetchall()
    out = []
    for rank, text in rows:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        out.append({"rank": rank, "origin": value})
    return out

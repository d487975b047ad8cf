"""The order of events in training time, and the verdict: the first anomaly, how far it
spread, the first non-finite origin and diverged replicas, in words."""

from __future__ import annotations

from collections.abc import Iterable

from ...anomaly.event import NAN_ORIGIN_RULE, REPLICA_RULE
from ...records.rows import BACKWARD, FORWARD, LOSS
from .events import AnomalyEvent, split_slot
from .kind import fault_kind


def order_events(events: Iterable[AnomalyEvent]) -> list[AnomalyEvent]:
    return sorted(events, key=AnomalyEvent.order_key)


def first_per_rank(ordered: list[AnomalyEvent]) -> dict[int, AnomalyEvent]:
    firsts: dict[int, AnomalyEvent] = {}
    for event in ordered:
        firsts.setdefault(event.rank, event)
    return firsts


def _same_tensor(a: AnomalyEvent, b: AnomalyEvent) -> bool:
    return (a.rank, a.step, a.micro_step, a.stage, a.category, a.name) == (
        b.rank,
        b.step,
        b.micro_step,
        b.stage,
        b.category,
        b.name,
    )


def verdict(ordered: list[AnomalyEvent], job_ranks: set[int] | None = None) -> str:
    """One paragraph: the first anomaly and its kind (kind.py; `job_ranks`: every rank of the
    job, where known), how far it spread, the first non-finite origin."""
    if not ordered:
        return "No anomaly recorded."
    first = ordered[0]
    # a NanOrigin record says where; the alert on the same tensor says what was wrong with it
    shown = next((e for e in ordered if e.rule != NAN_ORIGIN_RULE and _same_tensor(e, first)), first)
    firsts = first_per_rank(ordered)
    steps = sorted({e.step for e in ordered})
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    parts = [f"First anomaly: {first.where()}, {first.what()} ({shown.symptom()}; {shown.rule or 'rule unknown'})."]
    kind = fault_kind(ordered, job_ranks)
    if kind is not None:
        parts.append(kind.sentence())
    same_time = [r for r, e in firsts.items() if r != first.rank and e.order_key()[:5] == first.order_key()[:5]]
    if same_time:
        parts.append(
            f"At the same point of the step (same micro-step, stage and pipeline stage) it also shows on "
            f"rank{'s' if len(same_time) > 1 else ''} {_ranks(same_time)}."
        )
    parts.append(
        f"{len(ordered)} anomal{'y' if len(ordered) == 1 else 'ies'} in all, on "
        f"{len(firsts)} rank{'s' if len(firsts) != 1 else ''}, in {span}."
    )
    later = [e for r, e in sorted(firsts.items()) if r != first.rank and r not in same_time]
    if later:
        listed = "; ".join(f"rank {e.rank} at step {e.step} {e.stage} ({e.what()})" for e in later[:3])
        more = f"; and {len(later) - 3} more ranks" if len(later) > 3 else ""
        parts.append(f"Other ranks' first anomalies came later: {listed}{more}.")
    origin = next((e for e in ordered if e.rule == NAN_ORIGIN_RULE), None)
    if origin is not None:
        slot = split_slot(origin.name)[1]
        if origin.stage == FORWARD and slot == "input":
            why = (
                "the value was already non-finite when it reached this module (made outside any module, or by the data)"
            )
        elif origin.name == LOSS:
            why = "the loss, computed outside any module, sent a non-finite gradient back into the model"
        elif origin.category == "grad_reduced":
            why = (
                "it was non-finite as the optimizer got it while every activation gradient was finite "
                "(a tensor hook, a write into .grad, or another rank's gradient through the all-reduce)"
            )
        elif origin.stage == BACKWARD and slot == "output":
            why = (
                "the gradient was already non-finite when it reached this module "
                "(made outside any module: a tensor hook, or code between modules)"
            )
        else:
            feeds = "output" if origin.stage == FORWARD else "input gradient"
            why = f"the first module whose {feeds} was non-finite while everything that fed it was finite"
        if origin is first:
            parts.append(f"That is the first non-finite origin: {why}.")
        else:
            parts.append(f"First non-finite origin: {origin.where()}, {origin.what()}: {why}.")
    replicas = [e for e in ordered if e.rule == REPLICA_RULE]
    if replicas:
        parts.append(_replica_sentence(replicas))
    return " ".join(parts)


def _replica_sentence(events: list[AnomalyEvent]) -> str:
    """The first replica check that found data-parallel copies differing: which tensors, whose copy."""
    step = events[0].step
    at_step = [e for e in events if e.step == step]
    names = list(dict.fromkeys(e.name for e in at_step))
    ranks = sorted({e.rank for e in at_step})
    detail = events[0].message.removeprefix("replica check: ")
    more = (
        f" ({len(names)} tensors in all: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
        if len(names) > 1
        else ""
    )
    return (
        f"Data-parallel replicas diverged: the replica check of step {step} found {detail}{more}; "
        f"the copies on rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} are suspect (silent data corruption, "
        f"or an update or reduction that did not happen alike everywhere)."
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in sorted(ranks)[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def format_table(events: list[AnomalyEvent]) -> str:
    header = ("#", "rank", "step", "micro", "stage", "pp", "vpp", "call", "rule", "tensor", "op", "value", "history")
    rows = [header]
    for i, e in enumerate(events):
        rows.append(
            (
                str(i),
                str(e.rank),
                str(e.step),
                "-" if e.micro_step is None else str(e.micro_step),
                e.stage,
                str(e.pp_stage),
                str(e.vpp_stage),
                str(e.call_id),
                e.rule,
                f"{e.name} ({e.category})",
                e.op or "-",
                _num(e.value),
                _num(e.history),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"

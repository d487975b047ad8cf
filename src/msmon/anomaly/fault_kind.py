"""What kind of fault came first, told from where it arose on the data path (torch-free).

At the first anomalous step, each rank's anomalies are ordered by where they arise in training
(data_path.py: forward activations, the loss, activation gradients, rank-local gradients, then
the reduction, the optimizer state, the weights). What counts is whose *rank-local* values
turned: a NaN made by rank 1 reaches rank 0 through the gradient all-reduce in the same step,
but only in rank 0's reduced gradient and what follows it, never in its own activations, loss
or gradient. So:

- rank-local values turned on one rank only: that rank's fault. Where it entered the model as
  it was (a module's forward input, or the loss alone departing) it is the rank's data; where a
  module made it, or only the gradients show it, one step cannot tell a bad batch from a bad
  device, and the kind says exactly that (one_rank_data_or_device). A replica check naming
  the rank makes it the rank's copy of the model.
- rank-local values turned on every rank at that step: all ranks together (the batch every rank
  read alike, or the model and optimizer state they share).
- on some ranks, not all: those ranks.
- no rank-local value alerted: a replica-check divergence is that rank's copy of the model; a
  value after the reduction turned on one rank alone is its copy of the model or its optimizer
  state; on every rank, the reduction or the optimizer step.

The ranks compared are the job's ranks (every rank with the dump on makes its `rank{r}` folder
at start) and those with a record; they are taken as data-parallel replicas. Where a collective
runs inside the model (pipeline stages' sends, tensor parallelism, SyncBatchNorm) a rank's
activations are not its own alone, so a fault crossing it reads as several ranks (or all). One
rank alone has nothing to be told apart from: no kind.

`classify` takes the typed `PathEvent`s, so that `msmon analyse`, the report, the end-of-job
line and a run-time decision (an action taken once per step from every rank's view) tell the
kind alike; `KINDS` documents each code and what to do about it (docs/anomaly.md has the table).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from .data_path import PathEvent, arrived_at_input
from .event import NAN_ORIGIN_RULE, RANK_OUTLIER_RULE, REPLICA_RULE


@dataclass(frozen=True)
class Kind:
    """One kind of fault: its code, its words, what it means and what to do about it."""

    code: str
    words: str
    meaning: str
    action: str


ONE_RANK_DATA = Kind(
    "one_rank_data",
    "one rank's data",
    "one rank's rank-local values turned first, and they turned where the data enters: a module's forward input "
    "(a non-finite value in the batch), the rank's statistics departing first at an input, or its loss alone; "
    "its replicated weights agree (no replica check names it)",
    "skip or inspect the batches that rank read at that step; the device is not suspected",
)
ONE_RANK_DATA_OR_DEVICE = Kind(
    "one_rank_data_or_device",
    "one rank: its data or its device",
    "one rank's rank-local values turned first, on that rank only, made inside the model (a module's output or a "
    "gradient) from values that were in range; one step cannot tell a bad batch from a bad device",
    "rerun from the last checkpoint: if the same rank turns again on other batches, take its device out; if the "
    "batch turns another rank, it is the data",
)
ONE_RANK_MODEL_COPY = Kind(
    "one_rank_model_copy",
    "one rank's copy of the model",
    "a replica check found the rank's replicated weights differing, or only that rank's values after the reduction "
    "(reduced gradient, optimizer state, weights) turned while every rank's own values were in range",
    "the rank's device is suspected (silent data corruption): take it out and restart from the last checkpoint",
)
SOME_RANKS = Kind(
    "some_ranks",
    "some ranks, not all",
    "the rank-local values of several ranks, not all, turned first at the same step",
    "as for one rank, for each of them; ranks that share a host point at the host",
)
ALL_RANKS = Kind(
    "all_ranks",
    "all ranks together",
    "every rank's own rank-local values turned at the same step: the batch every rank read alike, or the model "
    "and optimizer state they share",
    "not a device: skip the batch or roll back and change what every rank shares (learning rate, loss scale, data)",
)
REDUCTION_OR_OPTIMIZER = Kind(
    "reduction_or_optimizer",
    "every rank after the reduction",
    "no rank's own activations, loss or gradient alerted; the reduced gradient, the optimizer state or the weights "
    "turned on every rank: the reduction or the optimizer step",
    "roll back; look at the optimizer's settings and state, and at the collective's health",
)
KINDS = {k.code: k for k in (ONE_RANK_DATA, ONE_RANK_DATA_OR_DEVICE, ONE_RANK_MODEL_COPY, SOME_RANKS, ALL_RANKS)}
KINDS[REDUCTION_OR_OPTIMIZER.code] = REDUCTION_OR_OPTIMIZER


@dataclass(frozen=True)
class FaultKind:
    """The kind told for the first anomaly: its code, where (step, rank or ranks), the first
    module and tensor (the non-finite origin, or the first departing tensor), and why."""

    code: str
    step: int
    rank: int | None  # the one rank, for the one-rank kinds
    why: str
    ranks: tuple[int, ...] = ()  # the ranks whose values turned first
    module: str | None = None
    tensor: str | None = None  # the first tensor, in words

    @property
    def kind(self) -> str:
        """In words ("one rank's data")."""
        return KINDS[self.code].words

    def sentence(self) -> str:
        if self.code == ONE_RANK_DATA_OR_DEVICE.code:  # its why says it of the rank: "rank 1: its data or ..."
            return f"Kind: {self.why}."
        return f"Kind: {self.kind}: {self.why}."

    def headline(self) -> str:
        """One line: the kind, the step, the rank and the first module."""
        where = [f"step {self.step}"]
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        elif self.ranks and self.code == SOME_RANKS.code:
            where.append("ranks " + ", ".join(map(str, self.ranks)))
        if self.module:
            where.append(f"first module {self.module}")
        return f"{self.kind} ({', '.join(where)})"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "code": self.code,
            "rank": self.rank,
            "ranks": list(self.ranks),
            "step": self.step,
            "module": self.module,
            "tensor": self.tensor,
            "why": self.why,
            "action": KINDS[self.code].action,
        }


def classify(events: Iterable[PathEvent], ranks: Collection[int] | None = None) -> FaultKind | None:
    """The kind of the first anomalous step of `events` (every rank's, any order); `ranks`: the
    job's ranks where known. None when there is no event or one rank only."""
    events = list(events)
    if not events:
        return None
    job = set(ranks or ()) | {e.rank for e in events}
    if len(job) < 2:
        return None
    step = min(e.step for e in events)
    at_step = sorted((e for e in events if e.step == step), key=PathEvent.position)
    local: dict[int, list[PathEvent]] = {}
    after: dict[int, list[PathEvent]] = {}
    for e in at_step:
        if e.rule == REPLICA_RULE:
            continue  # a comparison of the copies, not a value of this rank's step
        (local if e.rank_local else after).setdefault(e.rank, []).append(e)
    replicas = sorted((e for e in events if e.rule == REPLICA_RULE), key=lambda e: (e.step, e.position()))
    if not local:
        return _after_reduction(step, after, replicas, job)
    turned = sorted(local)
    if len(turned) == 1:
        return _one_rank(step, turned[0], local[turned[0]], after, replicas, len(job))
    first = _first(min((e for evs in local.values() for e in evs), key=PathEvent.position), at_step)
    if set(turned) == job:
        return _ranks_kind(
            ALL_RANKS,
            step,
            f"every rank ({len(job)}) turned at step {step} in its own rank-local values (first: {first.what()} on "
            f"rank {first.rank}): the batch every rank read alike, or the model and optimizer state they share, "
            "not one rank",
            turned,
            first,
        )
    calm = sorted(job - set(turned))
    return _ranks_kind(
        SOME_RANKS,
        step,
        f"ranks {_list(turned)}: their data or their devices; rank-local values turned first at step {step} on these "
        f"ranks only (first: {first.what()} on rank {first.rank}), not on rank{'s' if len(calm) > 1 else ''} "
        f"{_list(calm)}",
        turned,
        first,
    )


def _first(event: PathEvent, at_step: list[PathEvent]) -> PathEvent:
    """The non-finite origin of the event's rank at that step where it has one (it names where
    the value was made), else the event itself."""
    origin = next((e for e in at_step if e.rank == event.rank and e.rule == NAN_ORIGIN_RULE and e.rank_local), None)
    return origin or event


def _one_rank(
    step: int,
    rank: int,
    mine: list[PathEvent],
    after: dict[int, list[PathEvent]],
    replicas: list[PathEvent],
    size: int,
) -> FaultKind:
    first = _first(mine[0], mine)
    others = sorted(r for r in after if r != rank)
    others_text = (
        f"rank{'s' if len(others) > 1 else ''} {_list(others)} turned only after the reduction "
        f"({after[others[0]][0].what()})"
        if others
        else ("the other rank's" if size == 2 else "the other ranks'") + " own values stayed in range"
    )
    named = next((e for e in replicas if e.rank == rank), None)
    if named is not None:
        return FaultKind(
            ONE_RANK_MODEL_COPY.code,
            step,
            rank,
            f"rank {rank}'s rank-local values turned first at step {step}, on rank {rank} only (first: "
            f"{first.what()}), and the replica check found its replicated weights differing at step {named.step}",
            (rank,),
            first.module(),
            first.what(),
        )
    began = next((e for e in after.get(rank, ()) if e.category == "param_origin"), None)
    if began is not None and not any(e.category == "param_origin" for r in others for e in after[r]):
        # the weights are the same on every replica: alerting on one rank only, they differed as the step began
        return FaultKind(
            ONE_RANK_MODEL_COPY.code,
            step,
            rank,
            f"rank {rank}'s rank-local values turned first at step {step}, on rank {rank} only (first: "
            f"{first.what()}), and its {began.what()} alerted on rank {rank} alone: its copy of the model differed "
            "as the step began",
            (rank,),
            first.module(),
            first.what(),
        )
    outlier = mine[0].rule == RANK_OUTLIER_RULE
    at_input = arrived_at_input(first) or (first.category == "loss" and outlier)
    if at_input and outlier:
        return FaultKind(
            ONE_RANK_DATA.code,
            step,
            rank,
            f"rank {rank}'s rank-local statistics left the other ranks' at step {step}, first at the {first.what()}, "
            f"while its replicated weights agree (no replica-check divergence names it; with replica_check off they "
            f"are not checked); {others_text}: look at the batches rank {rank} read",
            (rank,),
            first.module(),
            first.what(),
        )
    if at_input:
        return FaultKind(
            ONE_RANK_DATA.code,
            step,
            rank,
            f"a value that entered rank {rank}'s model as it was, at the {first.what()}, turned first at step {step} "
            f"(its data, or code before that module), on rank {rank} only; {others_text}: look at the batch rank "
            f"{rank} read",
            (rank,),
            first.module(),
            first.what(),
        )
    how = "first non-finite there" if first.rule == NAN_ORIGIN_RULE else "the first to alert"
    return FaultKind(
        ONE_RANK_DATA_OR_DEVICE.code,
        step,
        rank,
        f"rank {rank}: its data or its device; rank-local values turned first, on rank {rank} only ({first.what()} at "
        f"step {step}, {how}); {others_text}. One step cannot tell a bad batch from a bad device: if rank {rank} "
        "turns again on other batches, it is the device",
        (rank,),
        first.module(),
        first.what(),
    )


def _after_reduction(
    step: int,
    after: dict[int, list[PathEvent]],
    replicas: list[PathEvent],
    job: set[int],
) -> FaultKind | None:
    """No rank-local value alerted at the first step: a replica divergence, or values after the
    reduction on one rank or on every rank."""
    checked = [e for e in replicas if e.step == step]
    if checked:
        named = sorted({e.rank for e in checked})
        e = checked[0]
        if len(named) == 1:
            why = (
                f"the replica check found rank {e.rank}'s replicated weights differing from the other ranks' at step "
                f"{step}"
            )
            return FaultKind(ONE_RANK_MODEL_COPY.code, step, e.rank, why, (e.rank,), e.module(), e.what())
        why = (
            f"the replica check found the copies of ranks {_list(named)} differing at step {step}, with no majority "
            "to tell whose copy is wrong (two replicas, or a tie)"
        )
        return FaultKind(ONE_RANK_MODEL_COPY.code, step, None, why, tuple(named), e.module(), e.what())
    if not after:
        return None
    turned = sorted(after)
    firsts = sorted((evs[0] for evs in after.values()), key=PathEvent.position)
    first = firsts[0]
    if len(turned) == 1:
        rank = turned[0]
        return FaultKind(
            ONE_RANK_MODEL_COPY.code,
            step,
            rank,
            f"only rank {rank}'s values after the reduction turned at step {step} (first: {first.what()}), while "
            "every rank's own activations, loss and gradients and the other ranks' reduced values were in range: "
            "its copy of the model or its optimizer state departed (its device, or a write into its weights or "
            "gradients)",
            (rank,),
            first.module(),
            first.what(),
        )
    if set(turned) == job:
        return _ranks_kind(
            REDUCTION_OR_OPTIMIZER,
            step,
            f"no rank's own activations, loss or gradient alerted at step {step}; every rank's {first.what()} "
            "turned first after the reduction: the reduction or the optimizer step, alike on every rank",
            turned,
            first,
        )
    calm = sorted(job - set(turned))
    return _ranks_kind(
        SOME_RANKS,
        step,
        f"ranks {_list(turned)}: their copies of the model or their optimizer state; only their values after the "
        f"reduction turned at step {step} (first: {first.what()}), not rank{'s' if len(calm) > 1 else ''} "
        f"{_list(calm)}'s, and no rank's own values",
        turned,
        first,
    )


def _ranks_kind(kind: Kind, step: int, text: str, turned: Iterable[int], first: PathEvent) -> FaultKind:
    """A kind of several ranks (no one rank named), placed at `first`, the earliest of their events."""
    return FaultKind(kind.code, step, None, text, tuple(turned), first.module(), first.what())


def _list(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")

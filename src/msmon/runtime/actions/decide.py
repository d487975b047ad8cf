"""One step's decision, the same on every rank: which actions its alerts, every rank's, call for.

Every rank holds the same alerts after the vote (vote.py), so every rank computes the same
triggers from them. An action's `on` matches an alert of a rule it names, or the kind of fault
anomaly/fault_kind.py's `classify` tells from the step's alerts (`verdict:<code>`), the same
function `msmon analyse` runs on the dump, with the voting ranks as the job's ranks.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

from ...anomaly.fault_kind import FaultKind, classify
from ...anomaly.seen import Seen
from ...config.schema import ActionConfig


@dataclass
class StepView:
    """Every voting rank's alerts of one step."""

    step: int
    seen: list[Seen]
    ranks: list[int]

    @cached_property
    def kind(self) -> FaultKind | None:
        """The kind of fault at this step (None: no alert, or one rank alone)."""
        return classify((s.path_event() for s in self.seen), self.ranks)

    def hosts(self, ranks: Iterable[int]) -> list[str]:
        wanted = set(ranks)
        return sorted({s.host for s in self.seen if s.rank in wanted and s.host})


@dataclass
class Trigger:
    """An action the step's alerts call for: the alerts that matched a rule of its `on`, and
    the step's kind of fault where a verdict of its `on` matched (else the kind, if told)."""

    index: int  # the action's place in alert.actions
    action: ActionConfig
    view: StepView
    matched: list[Seen] = field(default_factory=list)
    verdict: bool = False

    @property
    def step(self) -> int:
        return self.view.step

    @property
    def kind(self) -> FaultKind | None:
        return self.view.kind

    @property
    def ranks(self) -> list[int]:
        """The ranks it names: the verdict's, else those whose alerts matched."""
        kind = self.kind
        if self.verdict and kind is not None:
            return list(kind.ranks) or ([kind.rank] if kind.rank is not None else [])
        return sorted({s.rank for s in self.matched})

    def why(self) -> str:
        """In words: the verdict, or the first alert that matched."""
        kind = self.kind
        if self.verdict and kind is not None:
            return f"verdict {kind.code}: {kind.headline()}"
        first = self.matched[0]
        more = len({(s.rule, s.tensor, s.rank) for s in self.matched}) - 1
        others = f" and {more} more alert{'s' if more > 1 else ''}" if more > 0 else ""
        return f"{first.rule} on the {first.what()} on rank {first.rank} ({first.message}){others}"


def views(seen: Iterable[Seen], ranks: list[int]) -> list[StepView]:
    """The alerts grouped by step, the earliest step first."""
    by_step: dict[int, list[Seen]] = {}
    for one in seen:
        by_step.setdefault(one.step, []).append(one)
    ordered = {step: sorted(seen, key=lambda s: s.path_event().position()) for step, seen in by_step.items()}
    return [StepView(step, ordered[step], ranks) for step in sorted(ordered)]


def triggers(actions: list[ActionConfig], view: StepView) -> list[Trigger]:
    """The actions `view` calls for, in the order of alert.actions."""
    out = []
    for index, action in enumerate(actions):
        rules = set(action.rules)
        matched = [s for s in view.seen if s.rule in rules]
        verdict = bool(action.verdicts) and view.kind is not None and view.kind.code in action.verdicts
        if matched or verdict:
            out.append(Trigger(index, action, view, matched, verdict))
    return out

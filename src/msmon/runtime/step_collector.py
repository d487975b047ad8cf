"""What the runtime asks of the collectors, which sit above it: it names them by these protocols
and never imports them (collectors/base.py's Collector and collectors/micro_steps.py's tracker
are what the api builds and hands down)."""

from __future__ import annotations

from typing import Protocol


class StepCollector(Protocol):
    """A collector as the step runs it: attached and detached, called around the optimizer's
    update and at the end of every step, switched off by a failure (`enabled`)."""

    name: str
    enabled: bool

    def attach(self) -> None: ...

    def detach(self) -> None: ...

    def before_update(self) -> None: ...

    def after_update(self) -> None: ...

    def end_step(self) -> None: ...


class MicroSteps(Protocol):
    """The forward and backward micro-steps of the step, as the tracker counts them."""

    backward_micro: int

    def forward_micro(self, chunk: int) -> int: ...

    def in_gradless_forward(self, chunk: int) -> bool: ...

"""The sink interface the writer thread drives."""
from __future__ import annotations

from ..records import StepRecord


class Sink:
    """Receives one StepRecord per recorded step, on the writer thread."""

    name = "sink"

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make everything written so far durable (called after every step)."""

    def close(self) -> None:
        self.flush()

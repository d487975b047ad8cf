"""The sink interface the writer thread drives."""

from __future__ import annotations

from ..records import StepRecord


class Sink:
    """Receives one StepRecord per recorded step, on the writer thread."""

    name = "sink"
    writes_files = False  # True: an OSError from it means the output (the disk) failed

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make everything written so far durable (called after every step)."""

    def close(self) -> None:
        self.flush()


def naming(exc: OSError, path: str) -> OSError:
    """A failed write names no file (only a failed open does): say which file it was."""
    if exc.filename is None:
        exc.filename = path
    return exc

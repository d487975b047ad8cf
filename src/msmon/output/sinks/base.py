"""The sink interface the writer thread drives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...records.rows import StepRecord

if TYPE_CHECKING:
    from ...config import MonitorConfig


class Sink:
    """Receives one StepRecord per recorded step, on the writer thread."""

    name = "sink"  # the format's name, set by `sink_format` (the registry)
    writes_files = False  # True: an OSError from it means the output (the disk) failed

    @classmethod
    def for_rank(cls, log_dir: str, config: MonitorConfig) -> Sink:
        """The sink writing one rank's directory under the config in force."""
        return cls()

    def write(self, record: StepRecord) -> None:
        raise NotImplementedError

    def write_step(self, records: list[StepRecord]) -> None:
        """One step's records: its statistics, then one per category with its own columns (the
        loss, the gradient agreement, the L2 features). A sink that writes a step as one unit
        (TensorBoard's event) takes them together."""
        for record in records:
            self.write(record)

    def flush(self) -> None:
        """Make everything written so far durable (called after every step)."""

    def close(self) -> None:
        self.flush()


def naming(exc: OSError, path: str) -> OSError:
    """A failed write names no file (only a failed open does): say which file it was."""
    if exc.filename is None:
        exc.filename = path
    return exc

"""What the writer thread hands a written step to after the sinks: its consumers.

The writer only moves steps: it takes one off its queue, waits for the step's copy to reach the
host, gives the record to every sink and then to every consumer, in the order they were given.
What a step means (alert rules, the NaN origin, the anomaly dump) is a consumer that whoever
builds the rank output hands in, so the writer knows nothing of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..records.rows import RowKey, StepRecord

if TYPE_CHECKING:
    import torch


class HostRows(Protocol):
    """A step's rows on their way to the host, as the writer and its consumers read them
    (runtime/transfer.py's HostBatch: the runtime, above the output, builds it and hands it in).
    `wait()` blocks until they are there."""

    keys: list[RowKey]
    values: torch.Tensor
    histograms: list[tuple[str, list[float], torch.Tensor]]
    flag_keys: list[RowKey]

    def wait(self) -> None: ...

    def finite_flags(self) -> list[bool]: ...


class StepConsumer:
    """Takes every written step, on the writer thread, after the sinks have written it.

    An OSError raised by `consume` means a write to disk failed: the writer stops the rank's
    output (one line naming the file: give the path in the error's `filename`) and calls
    `output_stopped` on every consumer. Any other exception is logged for that step, as a failed
    write of the step is; the consumer is called again at the next step."""

    name = "consumer"
    alerts_raised = 0  # the alerts it raised (summary.json counts them with the rules')

    def consume(self, record: StepRecord, batch: HostRows) -> None:
        raise NotImplementedError

    def output_stopped(self) -> None:
        """A write to disk failed: write nothing more to disk (keep doing the rest)."""

    def writer_closed(self) -> None:
        """The writer has handed over its last step: finish with it (a bounded wait at most)."""

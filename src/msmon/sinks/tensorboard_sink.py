"""TensorBoard event files, written live by the tensorboard package's own writer."""
from __future__ import annotations

from ..records import StepRecord
from .base import Sink


class TensorBoardSink(Sink):
    """Scalars tagged `{vpp}:{name}/rank{r}/{category}_{op}`; histograms for update/ratio."""

    name = "tensorboard"

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=log_dir, flush_secs=5)

    def write(self, record: StepRecord) -> None:
        add = self._writer.add_scalar
        for key, values in zip(record.keys, record.values):
            prefix = key.tag(record.rank)
            for op, value in zip(record.ops, values):
                add(f"{prefix}_{op}", value, record.step)
        for tag, edges, counts in record.histograms:
            total = sum(counts)
            if total <= 0:
                continue
            centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
            value_sum = sum(c * n for c, n in zip(centres, counts))
            self._writer.add_histogram_raw(
                tag, min=edges[0], max=edges[-1], num=int(total), sum=value_sum,
                sum_squares=sum(c * c * n for c, n in zip(centres, counts)),
                bucket_limits=edges[1:], bucket_counts=counts, global_step=record.step)
        self.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

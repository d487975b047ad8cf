"""TensorBoard event files, written live by the tensorboard package's own event writer.

A step is one event holding every scalar and histogram of the step. torch's SummaryWriter
builds, checks and queues one event per `add_scalar`; at a thousand scalars per step that
costs the writer thread about fifteen times more CPU (docs/performance.md), which on a
machine with few cores is taken from the training. TensorBoard reads both forms the same way.
"""
from __future__ import annotations

import logging
import os
import time

from ..records import RowKey, StepRecord
from .base import Sink

_MAX_CACHED_ROWS = 1 << 16
_MAX_WAIT_S = 5  # restart_at: how far ahead an earlier run's events file may be dated and still be waited for
logger = logging.getLogger("msmon")


class TensorBoardSink(Sink):
    """Scalars tagged `{vpp}:{name}/rank{r}/{category}_{op}`; histograms for update/ratio."""

    name = "tensorboard"

    def __init__(self, log_dir: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._histogram = Event, Summary, HistogramProto
        self._log_dir, self._writer_class = log_dir, EventFileWriter
        self._writer = EventFileWriter(log_dir, flush_secs=5)
        self._tag_cache: dict[tuple, list[str]] = {}

    def _tags(self, key: RowKey, rank: int, ops: list[str]) -> list[str]:
        """The row's tags, one per op; the same rows come back every step, so they are kept."""
        cache_key = (key, rank, tuple(ops))
        tags = self._tag_cache.get(cache_key)
        if tags is None:
            if len(self._tag_cache) >= _MAX_CACHED_ROWS:
                self._tag_cache.clear()
            prefix = key.tag(rank)
            tags = self._tag_cache[cache_key] = [f"{prefix}_{op}" for op in ops]
        return tags

    def write(self, record: StepRecord) -> None:
        value = self._summary.Value
        values = [value(tag=tag, simple_value=v)
                  for key, row in zip(record.keys, record.values)
                  for tag, v in zip(self._tags(key, record.rank, record.ops), row)]
        for tag, edges, counts in record.histograms:
            histogram = self._histogram_of(edges, counts)
            if histogram is not None:
                values.append(value(tag=tag, histo=histogram))
        if values:
            self._writer.add_event(self._event(wall_time=time.time(), step=record.step,
                                               summary=self._summary(value=values)))
        self.flush()

    def restart_at(self, step: int) -> None:
        """Mark a resumed run (append_output): TensorBoard's readers hide this directory's
        earlier events at steps >= `step` (`SessionLog.START`, as `SummaryWriter(purge_step=)`)."""
        from tensorboard.compat.proto.event_pb2 import SessionLog

        self._sort_last()
        self._writer.add_event(self._event(wall_time=time.time(), step=step,
                                           session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def _sort_last(self) -> None:
        """Make this run's events file the last of the directory in name order, the order
        TensorBoard reads files in (`events.out.tfevents.<seconds>.<host>.<pid>.<n>`): an earlier
        run's file from the same second (or a clock a little ahead) can sort after it, and its
        events would then be read as the newer ones. Our file, holding only its header so far,
        is started again once the clock has passed that second (at most a few seconds, once)."""
        mine = os.path.basename(getattr(self._writer, "_file_name", ""))
        names = sorted(n for n in os.listdir(self._log_dir) if "tfevents" in n)
        if not names or names[-1] == mine or mine not in names:
            return
        latest = max((int(p[3]) for p in (n.split(".") for n in names if n != mine)
                      if len(p) > 3 and p[3].isdigit()), default=0)
        if latest - time.time() > _MAX_WAIT_S:
            logger.warning("msmon: %s holds an events file dated %.0f s ahead of this machine's clock; TensorBoard may "
                           "read it after this run's", self._log_dir, latest - time.time())
            return
        self._writer.close()
        os.remove(os.path.join(self._log_dir, mine))
        while int(time.time()) <= latest:
            time.sleep(0.05)
        self._writer = self._writer_class(self._log_dir, flush_secs=5)

    def _histogram_of(self, edges: list[float], counts: list[float]):
        """TensorBoard's histogram of bucket counts: limits are the right edges, sums from the
        bucket centres (the values themselves are not kept)."""
        total = sum(counts)
        if total <= 0:
            return None
        centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
        return self._histogram(min=edges[0], max=edges[-1], num=float(total),
                               sum=sum(c * n for c, n in zip(centres, counts)),
                               sum_squares=sum(c * c * n for c, n in zip(centres, counts)),
                               bucket_limit=list(edges[1:]), bucket=list(counts))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

"""TensorBoard event files, written live with the tensorboard package's record format.

A step is one event holding every scalar and histogram of the step. torch's SummaryWriter
builds, checks and queues one event per `add_scalar`; at a thousand scalars per step that
costs the writer thread about fifteen times more CPU (docs/performance.md), which on a
machine with few cores is taken from the training. TensorBoard reads both forms the same way.

The file is written on msmon's writer thread itself, as tensorboard's EventFileWriter lays it
out (same name, same first event), but without its own background thread: a write that fails
(a full disk) is an OSError here, reported once by the writer, not a thread's traceback.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import IO, TYPE_CHECKING, Any

import torch

from ...records.layout import without_rank
from ...records.rows import RowKey, StepRecord
from ...records.tfrecord import RecordFile
from . import sink_format, summary_wire
from .base import Sink, naming
from .heatmap import Heatmaps
from .summary_lanes import SummaryLanes

if TYPE_CHECKING:
    from ...config import MonitorConfig

_MAX_CACHED_ROWS = 1 << 16
_MAX_WAIT_S = 5  # restart_at: how far ahead an earlier run's events file may be dated and still be waited for
logger = logging.getLogger("msmon")


@sink_format("tensorboard")
class TensorBoardSink(Sink):
    """Scalars tagged `{vpp}:{name}/rank{r}/{category}_{op}`; histograms for update/ratio, and
    their heatmap images when the step's meta asks for them (heatmap_visualize). `by_rank`
    (tensorboard_layout): the tags without `rank{r}/`, plus the per-category summary lanes."""

    writes_files = True

    @classmethod
    def for_rank(cls, log_dir: str, config: MonitorConfig) -> TensorBoardSink:
        return cls(log_dir, by_rank=config.tensorboard_layout == "by_rank")

    def __init__(self, log_dir: str, by_rank: bool = False) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SourceMetadata
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
        from tensorboard.summary.writer.event_file_writer import _global_uid

        self._event, self._summary, self._histogram = Event, Summary, HistogramProto
        self._source_metadata, self._uid = SourceMetadata, _global_uid
        self._log_dir = log_dir
        self._prefix_cache: dict[tuple, list[bytes]] = {}
        self._heatmaps = Heatmaps()
        self._lanes = SummaryLanes(self._summary) if by_rank else None
        self._open_file()

    def _open_file(self) -> None:
        """A new events file holding its header event, named as EventFileWriter names it."""
        self.path = os.path.join(
            self._log_dir,
            "events.out.tfevents.%010d.%s.%s.%s" % (time.time(), socket.gethostname(), os.getpid(), self._uid.get()),  # noqa: UP031
        )
        self._file = open(self.path, "wb")
        self._writer = RecordFile(self._file)
        try:
            self._write(
                self._event(
                    wall_time=time.time(),
                    file_version="brain.Event:2",
                    source_metadata=self._source_metadata(writer="tensorboard.summary.writer.event_file_writer"),
                )
            )
            self.flush()
        except OSError:
            _close_quietly(self._file)
            raise

    def _prefixes(self, key: RowKey, rank: int, ops: list[str]) -> list[bytes]:
        """The row's scalar entries up to their values (summary_wire), one per op, tagged
        `{key.tag(rank)}_{op}`; the same rows come back every step, so they are kept."""
        cache_key = (key, rank, tuple(ops))
        prefixes = self._prefix_cache.get(cache_key)
        if prefixes is None:
            if len(self._prefix_cache) >= _MAX_CACHED_ROWS:
                self._prefix_cache.clear()
            tag = key.tag(None if self._lanes is not None else rank)
            prefixes = self._prefix_cache[cache_key] = [summary_wire.scalar_prefix(f"{tag}_{op}") for op in ops]
        return prefixes

    def write(self, record: StepRecord) -> None:
        self.write_step([record])

    def write_step(self, records: list[StepRecord]) -> None:
        """One event for the step: every record's scalars and histograms, and the summary lanes
        over all of them with one holders table (two text events of one tag and step would show
        TensorBoard only one)."""
        parts: list[bytes] = []
        tables: list[tuple[list[RowKey], list[str], torch.Tensor]] = []
        for record in records:
            prefixes = [p for key in record.keys for p in self._prefixes(key, record.rank, record.ops)]
            table = self._table_of(record) if prefixes else None
            if table is not None:
                parts.append(summary_wire.scalars(prefixes, summary_wire.float32_bytes(table)))
                tables.append((record.keys, record.ops, table))
            parts.extend(self._histogram_parts(record))
        if self._lanes is not None and tables:
            parts.extend(self._lanes.entries(tables))
        if parts:
            self._write_bytes(summary_wire.event(time.time(), records[0].step, b"".join(parts)))
        self.flush()

    def _histogram_parts(self, record: StepRecord) -> list[bytes]:
        parts = []
        value = self._summary.Value
        heatmap = record.meta.get("heatmap", False)
        for tag, edges, counts in record.histograms:
            if self._lanes is not None:
                tag = without_rank(tag, record.rank)
            histogram = self._histogram_of(edges, counts)
            if histogram is not None:
                parts.append(summary_wire.entry(value(tag=tag, histo=histogram).SerializeToString()))
            image = self._heatmaps.add(tag, counts) if heatmap else None
            if image is not None:
                image_tag, height, width, png = image
                picture = self._summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
                parts.append(summary_wire.entry(value(tag=image_tag, image=picture).SerializeToString()))
        return parts

    @staticmethod
    def _table_of(record: StepRecord) -> torch.Tensor:
        """The step's values as a [rows, ops] tensor (the host table the writer got, when it
        matches the record)."""
        table = record.table
        if table is not None and tuple(table.shape) == (len(record.keys), len(record.ops)):
            return table
        return torch.tensor(record.values, dtype=torch.float64).reshape(len(record.keys), len(record.ops))

    def _write_bytes(self, event: bytes) -> None:
        try:
            self._writer.write(event)
        except OSError as exc:
            raise naming(exc, self.path)

    def _write(self, event: Any) -> None:  # a tensorboard Event proto
        try:
            self._writer.write(event.SerializeToString())
        except OSError as exc:
            raise naming(exc, self.path)

    def restart_at(self, step: int) -> None:
        """Mark a resumed run (append_output): TensorBoard's readers hide this directory's
        earlier events at steps >= `step` (`SessionLog.START`, as `SummaryWriter(purge_step=)`)."""
        from tensorboard.compat.proto.event_pb2 import SessionLog

        self._sort_last()
        self._write(self._event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def _sort_last(self) -> None:
        """Make this run's events file the last of the directory in name order, the order
        TensorBoard reads files in (`events.out.tfevents.<seconds>.<host>.<pid>.<n>`): an earlier
        run's file from the same second (or a clock a little ahead) can sort after it, and its
        events would then be read as the newer ones. Our file, holding only its header so far,
        is started again once the clock has passed that second (at most a few seconds, once)."""
        mine = os.path.basename(self.path)
        names = sorted(n for n in os.listdir(self._log_dir) if "tfevents" in n)
        if not names or names[-1] == mine or mine not in names:
            return
        latest = max(
            (int(p[3]) for p in (n.split(".") for n in names if n != mine) if len(p) > 3 and p[3].isdigit()), default=0
        )
        if latest - time.time() > _MAX_WAIT_S:
            logger.warning(
                "msmon: %s holds an events file dated %.0f s ahead of this machine's clock; TensorBoard may "
                "read it after this run's",
                self._log_dir,
                latest - time.time(),
            )
            return
        self.close()
        os.remove(self.path)
        while int(time.time()) <= latest:
            time.sleep(0.05)
        self._open_file()

    def _histogram_of(self, edges: list[float], counts: list[float]) -> Any:  # a HistogramProto, or None
        """TensorBoard's histogram of bucket counts: limits are the right edges, sums from the
        bucket centres (the values themselves are not kept)."""
        total = sum(counts)
        if total <= 0:
            return None
        centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
        return self._histogram(
            min=edges[0],
            max=edges[-1],
            num=float(total),
            sum=sum(c * n for c, n in zip(centres, counts)),
            sum_squares=sum(c * c * n for c, n in zip(centres, counts)),
            bucket_limit=list(edges[1:]),
            bucket=list(counts),
        )

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            raise naming(exc, self.path)

    def close(self) -> None:
        try:
            self._file.close()  # closed even when its last flush fails
        except OSError as exc:
            raise naming(exc, self.path)


def _close_quietly(fh: IO[bytes]) -> None:
    try:
        fh.close()
    except OSError:
        pass

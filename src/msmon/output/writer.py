"""The background writer: waits for a step's copy, feeds the sinks, then the step's consumers.

File writing and the wait on the device happen here, so the training thread only launches
kernels and enqueues. The writer only moves steps: what a step means (the alert rules, the NaN
origin, the anomaly dump) is a consumer (output.handoff) handed in by whoever builds the rank
output. A failing sink is logged once and switched off. A write to disk that fails (OSError: a
full disk, a quota, a vanished mount) stops the rank's whole output, with one line naming the
cause; the in-memory API sink and training go on.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import Callable

from ..records.rows import StepRecord
from ..system.thread_priority import lower_this_threads_priority
from ..system.torch_threads import torch_on_this_thread_only
from .category_ops import CategoryColumns
from .directory import stopped_line, stopped_output
from .handoff import HostRows, StepConsumer
from .sinks.base import Sink
from .sinks.feature_rows import split_features

logger = logging.getLogger("msmon")
_STOP = object()
# Steps waiting to be written at most; then the training waits for the writer (it runs at the
# lowest priority, so on a machine kept busy by someone else it could otherwise fall behind
# without bound). Each waiting step holds its host table and histograms.
MAX_BACKLOG = 32


class BackgroundWriter:
    """One daemon thread per monitor; `drain()` waits until everything submitted is written."""

    def __init__(
        self,
        sinks: list[Sink],
        rank: int,
        consumers: list[StepConsumer] | None = None,
        on_output_stopped: Callable[[dict], None] | None = None,
        nice: int = 0,
        max_backlog: int = MAX_BACKLOG,
        category_ops: dict[str, list[str]] | None = None,
        on_step_done: Callable[[int], None] | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.on_step_done = on_step_done  # after a step's sinks and consumers, even when one failed
        self.columns = CategoryColumns(category_ops or {})  # the ops each category's rows keep
        self.rank = rank
        self.consumers = list(consumers or [])
        self.on_output_stopped = on_output_stopped
        self.output_stopped: dict | None = None  # the write that stopped the output (output.stopped_output)
        self._last_step = 0
        self.steps_written = 0
        self.cpu_seconds = 0.0  # this thread's CPU time: off the training thread, not free on few cores
        self.nice = nice
        self.max_backlog = max_backlog
        self.waited_for = 0  # steps whose submit waited for room in the queue
        self._queue: queue.Queue = queue.Queue(maxsize=max_backlog)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"msmon-writer-rank{rank}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def continue_from(self, previous: BackgroundWriter) -> None:
        """Carry on the counts of the writer this one replaces (an edit of the output settings
        restarts the writer; summary.json counts the whole run)."""
        self.steps_written = previous.steps_written

    def submit(self, step: int, ops: list[str], batch: HostRows, meta: dict | None = None) -> bool:
        """Queue a step for writing; waits only when `max_backlog` steps are already waiting.
        False when the writer is closed (the step is not written)."""
        if self._closed:
            return False
        item = (step, list(ops), batch, meta or {})
        if self._queue.qsize() < self.max_backlog:
            self._queue.put_nowait(item)
            return True
        if not self.waited_for:
            logger.warning(
                "msmon[rank %d]: step %d: the writer is %d steps behind (the machine's cores are busy); "
                "training waits for it whenever it falls this far behind (said once)",
                self.rank,
                step,
                self.max_backlog,
            )
        self.waited_for += 1
        self._queue.put(item)
        return True

    def drain(self) -> None:
        if not self._closed:
            self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=60)  # after the steps still waiting
        except queue.Full:
            logger.error(
                "msmon[rank %d]: the writer is stuck; %d steps are not written", self.rank, self._queue.qsize()
            )
        self._thread.join(timeout=60)
        for consumer in self.consumers:
            try:
                consumer.writer_closed()
            except Exception as exc:  # pragma: no cover - reported, never raised at exit
                logger.warning("msmon[rank %d]: closing the %s consumer failed: %r", self.rank, consumer.name, exc)
        for sink in list(self.sinks):
            if sink not in self.sinks:
                continue  # closed when the output stopped
            try:
                sink.close()
            except OSError as exc:
                if sink.writes_files:
                    self.stop_output(self._last_step, exc)
                else:
                    logger.warning("msmon[rank %d]: closing the %s sink failed: %s", self.rank, sink.name, exc)
            except Exception as exc:  # pragma: no cover - reported, never raised at exit
                logger.warning("msmon[rank %d]: closing the %s sink failed: %s", self.rank, sink.name, exc)
        atexit.unregister(self.close)

    def stop_output(self, step: int, exc: OSError, path: str | None = None) -> None:
        """A write to disk failed: say so once, close every file sink, write nothing more to disk."""
        if self.output_stopped is None:
            self.output_stopped = stopped_output(step, exc, path)
            logger.error(stopped_line(self.rank, self.output_stopped))
            if self.on_output_stopped is not None:
                self.on_output_stopped(self.output_stopped)
        for consumer in self.consumers:
            consumer.output_stopped()
        for sink in [s for s in self.sinks if s.writes_files]:
            self.sinks.remove(sink)
            try:
                sink.close()
            except Exception:
                pass  # it failed already; the files are closed all the same

    def _run(self) -> None:
        torch_on_this_thread_only()  # a team of its own would slow every parallel op of the training
        lower_this_threads_priority(self.nice)  # run when the training waits, not in its place
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                started = time.thread_time()
                try:
                    self._write(*item)
                finally:
                    self.cpu_seconds += time.thread_time() - started
            except Exception as exc:
                logger.error("msmon[rank %d]: writing step statistics failed: %r", self.rank, exc)
            finally:
                if item is not _STOP and self.on_step_done is not None:
                    self.on_step_done(item[0])
                self._queue.task_done()

    def _write(self, step: int, ops: list[str], batch: HostRows, meta: dict) -> None:
        batch.wait()
        keys, table, features = split_features(step, self.rank, batch.keys, batch.values, meta)
        record = StepRecord(
            step=step,
            rank=self.rank,
            ops=ops,
            keys=keys,
            histograms=[(tag, edges, counts.tolist()) for tag, edges, counts in batch.histograms],
            meta=meta,
            table=table,
        )
        self._last_step = step
        # every category keeps every op unless category_ops says otherwise; L2 features: their own
        # columns, no alert rules
        written = (self.columns.split(record) if self.columns.category_ops else [record]) + features
        for sink in list(self.sinks):
            if sink not in self.sinks:
                continue  # a file sink, and the output stopped at this step
            try:
                sink.write_step(written)  # one step's records: a sink may write them as one unit
            except Exception as exc:
                if isinstance(exc, OSError) and sink.writes_files:  # the disk failed: all output stops
                    self.stop_output(step, exc)
                    continue
                logger.error(
                    "msmon[rank %d]: the %s sink failed at step %d and is switched off: %r",
                    self.rank,
                    sink.name,
                    step,
                    exc,
                )
                self.sinks.remove(sink)
        self.steps_written += 1
        for consumer in list(self.consumers):  # a collector may subscribe one meanwhile
            try:
                consumer.consume(record, batch)
            except OSError as exc:  # a consumer's write to disk (the anomaly dump) failed
                self.stop_output(step, exc)

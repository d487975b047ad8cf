"""A rank's background thread for msmon's own collectives: jobs in, one at a time, off the
training thread.

The replica check and AnomalyRankOutlier each exchange a few numbers with the other
data-parallel ranks every checked step, through msmon's own gloo group (made by
collectors/replica_check/group.py's `own_group`). A collective waits for every member, so it
never runs on the training thread (a slow rank would stall every other rank's training) nor on
the writer thread (it would hold back the output). Each feature hands its steps to one
`ExchangeThread`, which runs them in the order they were put, the same on every rank, as a
collective needs. A failure (a rank gone, a gather timed out, a bug) is logged once and
switches the feature off through its state's `off` (jobs still queued are then skipped, taken
off the queue without being run), and training goes on. The thread keeps torch to one OpenMP
thread (system/torch_threads.py) and is a daemon: a queue the other ranks never drain does not
keep the process alive; `flush` waits a bounded time for what is left when the monitor closes.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Generic, Protocol, TypeVar

from ..system.torch_threads import torch_on_this_thread_only

logger = logging.getLogger("msmon")


class StepJob(Protocol):
    """A job: the step it belongs to, for the failure's line."""

    @property
    def step(self) -> int: ...


class Switchable(Protocol):
    """A feature's state: why it is off, or None while it is on."""

    off: str | None


Job = TypeVar("Job", bound=StepJob)


class ExchangeThread(Generic[Job]):
    """One feature's exchange thread and its queue of jobs (made with the feature's state, so
    that it survives the monitor's collector rebuilds; started when the feature has its group)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.thread: threading.Thread | None = None

    def start(
        self,
        name: str,
        rank: int,
        state: Switchable,
        run: Callable[[Job], None],
        what: str,
        doing: str,
        failed: Callable[[], None] | None = None,
    ) -> None:
        """Run `run(job)` for each job put, while `state.off` is None. On an exception:
        `state.off = f"{doing} failed: {exc!r}"`, one error line naming `what` and the step, then
        `failed()` (say, to write the feature's report)."""

        def loop() -> None:
            torch_on_this_thread_only()  # a team of its own would slow every parallel op of the training
            while True:
                job = self.jobs.get()
                try:
                    if state.off is None:
                        run(job)
                except Exception as exc:  # contained: the feature stops, training goes on
                    state.off = f"{doing} failed: {exc!r}"
                    logger.error(
                        "msmon[rank %d]: %s at step %d failed and is switched off; training continues: %r",
                        rank,
                        what,
                        job.step,
                        exc,
                    )
                    if failed is not None:
                        failed()
                finally:
                    self.jobs.task_done()

        self.thread = threading.Thread(target=loop, name=name, daemon=True)
        self.thread.start()

    def put(self, job: Job) -> None:
        """Queue a job for the thread (never blocks: the queue is unbounded)."""
        self.jobs.put(job)

    @property
    def pending(self) -> int:
        """Jobs put and not yet done (queued or running)."""
        return self.jobs.unfinished_tasks

    def flush(self, seconds: float) -> int:
        """Wait at most `seconds` for the jobs put so far; how many are still not done (0: all)."""
        jobs = self.jobs
        with jobs.all_tasks_done:
            jobs.all_tasks_done.wait_for(lambda: not jobs.unfinished_tasks, seconds)
            return jobs.unfinished_tasks

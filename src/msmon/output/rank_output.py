"""One rank's output: its directory, the writer thread and its sinks, summary.json, the cost line.

Once a write to disk fails (a full disk), the rank writes nothing more to disk and says so once
(output.stopped_output); the in-memory API sink keeps generate_*_metrics working.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Callable

from ..anomaly.dump import AnomalyDumpWriter
from ..anomaly.rules import RuleEngine, build_rules
from ..config import MonitorConfig
from ..config.resolved import resolved
from ..records.layout import CONFIG_FILE, SUMMARY_FILE, rank_dir_name
from ..records.runs import current_run_id, write_run_file
from ..system.environment import ENV_BOOTSTRAP_DIR
from ..system.thread_priority import writer_nice
from . import resume
from .alerts import AlertConsumer
from .directory import stopped_line, stopped_output
from .handoff import StepConsumer
from .repeats import AlertRepeats
from .sinks import build_sinks
from .sinks.api_sink import ApiSink
from .writer import BackgroundWriter

logger = logging.getLogger("msmon")


class RankOutput:
    """The output of one monitor on one rank. `step` tells the current step (for the record of a
    failed write)."""

    def __init__(self, rank: int, output_base: str, step: Callable[[], int]) -> None:
        self.rank = rank
        self.output_base = output_base
        self._step = step
        self.log_dir: str | None = None
        self.resume: resume.Resume | None = None  # append_output: continuing an earlier run's directory
        self.writer: BackgroundWriter | None = None
        self.alerts: AlertConsumer | None = None  # the anomaly pipeline the writer hands each step to
        self.watchers: list[StepConsumer] = []  # consumers collectors subscribed (kept across writer restarts)
        self.repeats = AlertRepeats(rank)  # every rule's alerts so far: one line per rule and tensor (repeats.py)
        self.api: ApiSink | None = None
        self.stopped: dict | None = None  # the write to disk that failed (output.stopped_output)

    def open(self, config: MonitorConfig) -> None:
        """The rank directory (a new one, or the earlier run's with append_output) and the writer."""
        try:
            self.log_dir, self.resume = resume.open_rank_dir(self.output_base, self.rank, config.append_output)
            run_id = current_run_id()
            if run_id is not None:
                write_run_file(self.log_dir, run_id, self.rank)
        except OSError as exc:
            self.log_dir = os.path.join(self.output_base, rank_dir_name(self.rank))
            self._failed(exc, self.log_dir)
        self.start_writer(config)

    def start_writer(self, config: MonitorConfig) -> None:
        """The writer and its sinks; once a write to disk failed, only the in-memory API sink."""
        assert self.log_dir is not None
        sinks = []
        if self.stopped is None:
            config_path = os.path.join(self.log_dir, CONFIG_FILE)
            try:
                with open(config_path, "w", encoding="utf-8") as fh:
                    json.dump(resolved(config), fh, indent=2)
                    fh.write("\n")
                sinks = build_sinks(config.format, self.log_dir, config)
            except OSError as exc:
                self._failed(exc, config_path)
        self.api = next((s for s in sinks if isinstance(s, ApiSink)), None)
        if self.api is None:  # the generate_*_metrics API works whatever the format
            self.api = ApiSink()
            sinks.append(self.api)
        rules = RuleEngine(build_rules(config.alert.rules))
        self.alerts = AlertConsumer(self.rank, rules, config.alert.max_lines_per_step, self.repeats)
        self.writer = BackgroundWriter(
            sinks,
            self.rank,
            [self.alerts, *self.watchers],
            on_output_stopped=self._stopped,
            nice=writer_nice(),
            category_ops=config.category_ops,
        )

    def restart_writer(self, config: MonitorConfig) -> None:
        """New sinks for edited output settings; the counts go on."""
        previous, previous_alerts = self.writer, self.alerts
        if previous is None:
            return
        previous.close()  # writes what is pending with the old sinks
        self.start_writer(config)
        assert self.writer is not None and self.alerts is not None and previous_alerts is not None
        self.writer.continue_from(previous)
        self.alerts.continue_from(previous_alerts)

    def enable_dump(self, config: MonitorConfig, pp_stage: int, group_mates: list[int]) -> None:
        """The anomaly dump, once alerts are to be dumped (and nothing stopped the output)."""
        if self.stopped is not None:
            return
        if self.alerts is not None and config.alert.dump and self.alerts.dump is None:
            self.alerts.dump = AnomalyDumpWriter(self.output_base, self.rank, pp_stage, group_mates)

    def watch_steps(self, consumer: StepConsumer) -> None:
        """Hand `consumer` every written step from now on, after the anomaly pipeline, for the
        rest of the run (a collector that needs the step's values on the host)."""
        self.watchers.append(consumer)
        if self.writer is not None:
            self.writer.consumers.append(consumer)

    def anomaly_dump(self) -> AnomalyDumpWriter | None:
        return self.alerts.dump if self.alerts is not None else None

    @property
    def alerts_raised(self) -> int:
        """Alerts of the whole run (summary.json)."""
        own = self.alerts.alerts_raised if self.alerts is not None else 0
        return own + sum(watcher.alerts_raised for watcher in self.watchers)

    @property
    def first_origin(self) -> dict | None:
        """Where the run's first non-finite value was made (nan_origin), for summary.json."""
        return self.alerts.first_origin if self.alerts is not None else None

    def metrics(self, category: str) -> dict[str, dict[str, float]]:
        """{tag: {op: value}} of the last recorded step, once everything submitted is written."""
        if self.writer is not None:
            self.writer.drain()
        return self.api.metrics(category) if self.api is not None else {}

    def _failed(self, exc: OSError, path: str) -> None:
        """Setting the output up failed (a full disk): one line, and nothing is written to disk."""
        self._stopped(stopped_output(self._step(), exc, path))
        assert self.stopped is not None
        logger.error(stopped_line(self.rank, self.stopped))

    def _stopped(self, info: dict) -> None:
        if self.stopped is None:
            self.stopped = info

    # -- the end of the run -----------------------------------------------------------------------
    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.log_dir is None:
            return
        path = os.path.join(self.log_dir, SUMMARY_FILE)
        tmp = path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(summary, fh, indent=2)
                fh.write("\n")
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.remove(tmp)
            except OSError:
                pass
            if self.stopped is None:
                logger.warning("msmon[rank %d]: could not write %s: %s", self.rank, path, exc)
            else:  # its cause is said already, and the launcher has it from the worker record
                logger.debug("msmon[rank %d]: could not write %s: %s", self.rank, path, exc)


def report_cost(rank: int, line: str) -> None:
    """Tell the user what monitoring cost. Under `msmon run` the launcher prints every rank's
    line at the end of the job. With the API, every rank logs its line to the "msmon" logger
    at INFO when logging is set up for it; otherwise rank 0 prints its line on stderr (every
    rank's is in its summary.json either way)."""
    if os.environ.get(ENV_BOOTSTRAP_DIR):
        logger.debug(line)
    elif logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info(line)
    elif rank == 0:
        print(line, file=sys.stderr, flush=True)

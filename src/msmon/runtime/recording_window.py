"""Which steps are recorded: start_step, step_interval, collect_times, dynamic_on.

Under msprobe's dynamic mode (DYNAMIC_MONITOR=1 in the environment) nothing is recorded until
the config file turns dynamic_on on; an edit that turns it on starts the window at the current
step.
"""

from __future__ import annotations

import os

from ..config import MonitorConfig
from ..system.environment import ENV_DYNAMIC_MONITOR


class RecordingWindow:
    """The steps of the run the config records, and how many of them were recorded."""

    def __init__(self, config: MonitorConfig) -> None:
        self.start: int | None = config.start_step
        if os.environ.get(ENV_DYNAMIC_MONITOR, "").lower() in ("1", "true") and not config.dynamic_on:
            self.start = None  # msprobe's dynamic mode: wait for dynamic_on in the file
        self.collected = 0  # steps recorded since the window (re)started

    def records(self, step: int, config: MonitorConfig) -> bool:
        """Whether `step` is recorded."""
        start = self.start
        return (
            start is not None
            and step >= start
            and (step - start) % config.step_interval == 0
            and self.collected < config.collect_times
        )

    def recorded_one(self) -> None:
        self.collected += 1

    def closed_after(self, was_recording: bool, config: MonitorConfig) -> bool:
        """Whether the step just recorded was the window's last (collect_times reached): hooks can go."""
        return was_recording and self.collected >= config.collect_times and not config.dynamic_on

    def reconfigure(self, old: MonitorConfig, new: MonitorConfig, step: int) -> None:
        """An edit of the window's settings (or dynamic_on) restarts it."""
        if (
            new.dynamic_on
            or new.start_step != old.start_step
            or new.step_interval != old.step_interval
            or new.collect_times != old.collect_times
        ):
            self.start = max(new.start_step, step) if new.dynamic_on else new.start_step
            self.collected = 0

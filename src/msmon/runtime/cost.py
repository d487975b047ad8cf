"""The monitor's own cost, as the user sees it at the end of a run without a benchmark.

Every entry into monitor code on the training thread (hooks, the step callbacks) adds its
wall time to `seconds`. The cost is reported relative to the steps after the first: the first
step holds one-off work (the first hooks' setup, lazy allocations, the writer's warm-up), and
the time between attaching and the first step holds the user's own set-up, which would only
dilute the figure. The writer thread's CPU time is reported next to it, because it is off the
training thread but not free on a machine with few cores.
"""

from __future__ import annotations

import time
from typing import Any


class CostMeter:
    """Time spent in monitor code on the training thread, per step and as a share of the step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0
        self._attached_at: float | None = None
        self._first_end: float | None = None
        self._seconds_at_first_end = 0.0
        self._last_end: float | None = None

    def attached(self) -> None:
        self._attached_at = time.perf_counter()

    def step_ended(self, now: float) -> None:
        self.steps += 1
        self._last_end = now
        if self._first_end is None:
            self._first_end = now
            self._seconds_at_first_end = self.seconds

    def report(self, writer_cpu_seconds: float | None = None) -> dict[str, Any]:
        """Totals, and per step over the steps after the first (over all of them if only one)."""
        if self.steps >= 2 and self._first_end is not None and self._last_end is not None:
            steps, wall = self.steps - 1, self._last_end - self._first_end
            spent = self.seconds - self._seconds_at_first_end
        elif self.steps == 1 and self._attached_at is not None and self._last_end is not None:
            steps, wall, spent = 1, self._last_end - self._attached_at, self.seconds
        else:
            steps, wall, spent = 0, 0.0, self.seconds
        out: dict[str, Any] = {
            "monitor_seconds": round(self.seconds, 6),
            "steps_timed": steps,
            "step_ms": round(1000 * wall / steps, 3) if steps else None,
            "monitor_ms_per_step": round(1000 * spent / steps, 3) if steps else None,
            "monitor_cost_pct": round(100 * spent / wall, 3) if wall > 0 else None,
        }
        if writer_cpu_seconds is not None:
            out["writer_cpu_seconds"] = round(writer_cpu_seconds, 6)
            out["writer_cpu_ms_per_step"] = round(1000 * writer_cpu_seconds / self.steps, 3) if self.steps else None
        return out


def describe(report: dict[str, Any]) -> str:
    """One line for a person: '2.1 % of step time (1.3 ms of 61.0 ms per step), writer 0.8 ms/step'."""
    if report.get("monitor_cost_pct") is None:
        return "monitor cost not measured (fewer than one full step)"
    line = (
        f"monitor cost {report['monitor_cost_pct']:.1f} % of step time "
        f"({report['monitor_ms_per_step']:.1f} ms of {report['step_ms']:.1f} ms per step on the training thread"
    )
    if report.get("writer_cpu_ms_per_step") is not None:
        line += f"; writer thread {report['writer_cpu_ms_per_step']:.1f} ms CPU per step"
    return line + ")"

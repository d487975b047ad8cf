"""How much `msmon report`'s page holds at most, whatever the size of the run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Limits:
    """Bounds on what the page holds, whatever the size of the run."""

    max_steps: int = 120  # heatmap columns
    max_rows: int = 64  # heatmap rows (tensors)
    movers: int = 8  # per category and op
    spread_rows: int = 25
    timeline_points: int = 4000
    first_anomalies: int = 20
    cost_bars: int = 1024

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
    line_ranks: int = 16  # up to this many ranks a line chart has a line per rank; above, a band
    outlier_lines: int = 3  # over a band: the lines of the ranks that depart most from the median
    # line values of all heatmap rows' charts together (2 bytes each, 2.7 in base64: at most
    # about 4 MB); more and neighbouring steps are merged in the charts
    series_values: int = 1_500_000
    loss_points: int = 600  # points per loss line: more micro-steps and steps are averaged
    rank_outliers: int = 20  # rows of the per-rank outlier table

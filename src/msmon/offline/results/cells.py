"""How the page carries a grid of values: uint16 codes on a log scale, and ranks, in base64.

A heatmap or a line chart of 100,000 values would be megabytes of JSON numbers; as two bytes
each it is a tenth of that, and the page's script decodes it with a DataView. The codes below
FIRST_LEVEL say what a cell is when it has no value to scale.
"""

from __future__ import annotations

import base64
import math
import struct

EMPTY, ZERO, NONFINITE, FIRST_LEVEL, LAST_LEVEL = 0, 1, 2, 3, 65535
NO_RANK = 65535  # a cell's rank when no rank holds a value (ranks above 65534 show as none)


def encode_cells(cells: list[list[tuple[float | None, bool]]]) -> tuple[str, float | None, float | None]:
    """Cells as base64 little-endian uint16 codes on a log scale over the heatmap's own range
    (lo and hi are None when no cell holds a positive value)."""
    logs = [math.log10(v) for row in cells for v, bad in row if v is not None and v > 0 and not bad]
    lo, hi = (min(logs), max(logs)) if logs else (0.0, 0.0)
    scale = (LAST_LEVEL - FIRST_LEVEL) / (hi - lo) if hi > lo else 0.0
    codes = []
    for row in cells:
        for v, bad in row:
            if bad:
                codes.append(NONFINITE)
            elif v is None:
                codes.append(EMPTY)
            elif v <= 0:
                codes.append(ZERO)
            else:
                codes.append(FIRST_LEVEL + round((math.log10(v) - lo) * scale))
    data = base64.b64encode(struct.pack(f"<{len(codes)}H", *codes)).decode("ascii")
    return (data, lo, hi) if logs else (data, None, None)


def encode_ranks(ranks: list[int | None]) -> str:
    """Ranks as base64 little-endian uint16, NO_RANK where none holds the value."""
    codes = [NO_RANK if r is None or not 0 <= r < NO_RANK else r for r in ranks]
    return base64.b64encode(struct.pack(f"<{len(codes)}H", *codes)).decode("ascii")

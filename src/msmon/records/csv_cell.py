"""How a statistic reads in a CSV cell: `repr(csv_value(v, ndigits))`, torch-free.

The live CSV sink writes its cells this way (sinks/numbers.py formats whole tables with the
same rule) and `msmon convert tb2csv` writes them again from TensorBoard, without torch. msprobe
writes `round(v, ndigits)`: fixed decimals, so a small non-zero value (Adam's exp_avg_sq is
often 1e-10) reads 0.0. Here a magnitude of 1 or more keeps exactly that format, and one below
1 keeps `ndigits` significant digits instead. A count (`nans`, `infs`: the op table's "count"
kind) is written as the integer it is, `0` and not `0.0`.
"""

from __future__ import annotations


def csv_value(value: float, ndigits: int) -> float:
    """`round(value, ndigits)` for |value| >= 1, zero, NaN and infinities; `ndigits`
    significant digits (at least one) for 0 < |value| < 1."""
    if value == 0.0 or not abs(value) < 1.0:
        return round(value, ndigits)
    return float(f"{value:.{max(ndigits, 1)}g}")


def count_value(value: float) -> float:  # an int where whole (int is a float to type checkers)
    """A count op's value for its cell: the integer (`repr` gives `3`, not `3.0`); a value that
    is no whole number (NaN, an infinity) as it is."""
    return int(value) if value == value and abs(value) != float("inf") and value == int(value) else value

"""The names of what msmon writes, in one torch-free place: the monitor writes them, and the
offline readers (`msmon analyse`, `msmon convert`, `msmon db`, the launcher's summary) find
them without importing torch."""

from __future__ import annotations

DUMP_DIR = "anomaly_detected"  # <out>/anomaly_detected/rank<r>/anomaly.jsonl
DUMP_FILE = "anomaly.jsonl"
MSPROBE_DUMP_FILE = "anomaly.json"  # msprobe's name, read as well
SUMMARY_FILE = "summary.json"  # per rank directory: what was recorded and what it cost
CONFIG_FILE = "config.json"  # per rank directory: the config in force


def format_tag(display: str, rank: int, what: str) -> str:
    """A metric tag without the op, `{display}/rank{r}/{what}`: the one tag format (sinks append `_{op}`)."""
    return f"{display}/rank{rank}/{what}"

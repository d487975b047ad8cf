"""What alert.actions did, for the report: each escalation and each skipped step once (every rank
records the same ones), in step order, from the `actions` table (summary_loader.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection

MAX_SPANS = 200  # a bounded page: the first ones in step order


def action_spans(con: DuckDBPyConnection) -> list[dict[str, Any]]:
    """[{action, first_step, last_step, alert_step, why, keys}] in step order, at most MAX_SPANS."""
    rows = con.execute(
        "SELECT action, first_step, last_step, min(alert_step), min(why), min(keys) FROM actions "
        "GROUP BY action, first_step, last_step ORDER BY first_step, action LIMIT ?",
        [MAX_SPANS],
    ).fetchall()
    return [
        {"action": a, "first_step": f, "last_step": la, "alert_step": s, "why": w or "", "keys": k or ""}
        for a, f, la, s, w, k in rows
    ]

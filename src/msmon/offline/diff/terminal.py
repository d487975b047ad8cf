"""The comparison as the terminal shows it: both sides, the contract, how each category was
compared, the tolerance, the verdict with its interpretation, and the front as a table."""

from __future__ import annotations

from .contract import tensor_lines
from .outcome import Outcome

FRONT_LINES = 20


def lines(outcome: Outcome) -> list[str]:
    out = [f"A: {outcome.a.describe()}", f"B: {outcome.b.describe()}"]
    out += outcome.a.run_lines + outcome.b.run_lines
    contract = outcome.contract
    if contract.same:
        out.append("same: " + "; ".join(contract.same))
    out += ["differs: " + line for line in contract.differs]
    out += ["unknown: " + line for line in contract.unknown]
    out += tensor_lines(contract)
    out.append(f"layout: {outcome.layout.why}")
    modes: dict[str, list[str]] = {}
    for category, text in outcome.categories.items():
        modes.setdefault(text, []).append(category)
    for text, categories in modes.items():
        out.append(f"compared {text}: {', '.join(categories)}")
    out.append(f"tolerance: {outcome.tolerance.describe()}")
    out.append(f"result: {outcome.verdict()}")
    if outcome.interpretation:
        out.append(f"implies: {outcome.interpretation}")
    if outcome.first is not None:
        out += front_table(outcome)
    return out


def front_table(outcome: Outcome) -> list[str]:
    """Steps with rows over the tolerance: per category the tensors over, and the largest difference."""
    rows = [r for r in outcome.front() if r["over"]]
    categories = sorted({c for r in rows for c, v in r["categories"].items() if v["over"]})
    head = ["step", "tensors over"] + categories + ["largest relative difference"]
    table = [head]
    for r in rows[:FRONT_LINES]:
        largest = r["largest"]
        where = (
            f"{largest['relative_difference']:.3g} {largest['category']} {largest['name']} {largest['op']}"
            + (f" (rank {largest['rank']})" if largest["statistic"] == "rank" else f" ({largest['statistic']})")
            if largest and isinstance(largest["relative_difference"], float)
            else (f"{largest['relative_difference']} {largest['category']} {largest['name']}" if largest else "")
        )
        table.append(
            [str(r["step"]), str(r["tensors_over"])]
            + [str(r["categories"].get(c, {}).get("tensors_over", "")) for c in categories]
            + [where]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    text = ["front (steps with tensors over the tolerance):"]
    for row in table:
        text.append("  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    if len(rows) > FRONT_LINES:
        text.append(f"  ... {len(rows) - FRONT_LINES} more steps (--json FILE has every step)")
    return text

"""`--html FILE`: one self-contained page (no script, nothing fetched): the verdict and what it
implies, both sides and the contract, the front, and for the tensors that part most (20 at
most) A and B as two lines over steps, the step where the runs part marked."""

from __future__ import annotations

import html
import math
import os

from .contract import tensor_lines
from .outcome import Outcome, Series

WIDTH, HEIGHT, PAD = 560, 170, 40
STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px}
.verdict{font-size:16px;padding:10px;border-radius:4px}
.parted{background:#fde2e1} .within{background:#e3f5e1}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3} td.l,th.l{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:16px} .chart{border:1px solid #ddd;padding:6px}
.chart h3{font-size:13px;margin:2px 0 4px;font-weight:600}
.a{stroke:#1f77b4} .b{stroke:#ff7f0e} .part{stroke:#d62728;stroke-dasharray:4 3}
.legend span{margin-right:12px} small{color:#666}
"""


def write_page(outcome: Outcome, path: str) -> None:
    text = page(outcome)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def page(outcome: Outcome) -> str:
    e = html.escape
    parted = outcome.first is not None
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>msmon diff</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>msmon diff</h1>",
        f"<p>A: {e(outcome.a.describe())}<br>B: {e(outcome.b.describe())}</p>",
        f"<div class='verdict {'parted' if parted else 'within'}' id='verdict'>{e(outcome.verdict())}</div>",
    ]
    if outcome.interpretation:
        parts.append(f"<p id='implies'><b>Implies:</b> {e(outcome.interpretation)}</p>")
    parts.append(f"<p>Tolerance: {e(outcome.tolerance.describe())}<br>Layout: {e(outcome.layout.why)}</p>")
    parts.append("<h2>Contract</h2><ul>")
    contract = outcome.contract
    parts += [f"<li>same: {e(s)}</li>" for s in contract.same]
    parts += [f"<li><b>differs:</b> {e(s)}</li>" for s in contract.differs]
    parts += [f"<li>unknown: {e(s)}</li>" for s in contract.unknown]
    parts += [f"<li>{e(s)}</li>" for s in tensor_lines(contract)]
    parts += [f"<li>{e(c)}: compared {e(t)}</li>" for c, t in outcome.categories.items()]
    parts.append("</ul>")
    parts += _front(outcome)
    parts.append(f"<h2>The {len(outcome.series)} tensors that part most</h2>")
    if not outcome.series:
        parts.append("<p>None: every value compared is the same on both sides.</p>")
    parts.append(
        "<p class='legend'><span style='color:#1f77b4'>&#9644; A</span><span style='color:#ff7f0e'>&#9644; B</span>"
        "<span style='color:#d62728'>&#9476; first step over the tolerance</span></p>"
    )
    parts.append("<div class='charts'>")
    first_step = outcome.first.step if outcome.first else None
    parts += [_chart(s, first_step) for s in outcome.series]
    parts.append("</div></body></html>")
    return "\n".join(parts)


def _front(outcome: Outcome) -> list[str]:
    e = html.escape
    rows = [r for r in outcome.front() if r["over"]]
    if not rows:
        return []
    categories = sorted({c for r in rows for c, v in r["categories"].items() if v["over"]})
    out = [
        "<h2>Front: tensors over the tolerance per step</h2><table id='front'><tr><th>step</th><th>tensors over</th>"
    ]
    out += [f"<th>{e(c)}</th>" for c in categories]
    out.append("<th class='l'>largest relative difference</th></tr>")
    for r in rows[:200]:
        largest = r["largest"] or {}
        rel = largest.get("relative_difference")
        where = " ".join(
            [f"{rel:.3g}" if isinstance(rel, float) else str(rel or "")]
            + [str(largest.get(k, "")) for k in ("category", "name", "op")]
        )
        cells = "".join(f"<td>{r['categories'].get(c, {}).get('tensors_over', '')}</td>" for c in categories)
        out.append(f"<tr><td>{r['step']}</td><td>{r['tensors_over']}</td>{cells}<td class='l'>{e(where)}</td></tr>")
    out.append("</table>")
    return out


def _chart(s: Series, first_step: int | None) -> str:
    e = html.escape
    cell = s.cell
    who = (
        f"rank {cell.rank}" if cell.statistic == "rank" else "copies" if cell.statistic == "tensor" else cell.statistic
    )
    title = f"{cell.category} {cell.name} {cell.op} ({who}): largest relative difference {cell.relative:.3g}"
    values = [v for v in s.a + s.b if v is not None and math.isfinite(v)]
    if not s.steps or not values:
        return f"<div class='chart'><h3>{e(title)}</h3><small>no finite values</small></div>"
    lo, hi = min(values), max(values)
    if hi == lo:
        lo, hi = lo - (abs(lo) or 1) * 1e-6, hi + (abs(hi) or 1) * 1e-6
    first, last = s.steps[0], s.steps[-1]

    def x(step: int) -> float:
        return PAD + (WIDTH - 2 * PAD) * ((step - first) / (last - first) if last > first else 0.5)

    def y(v: float) -> float:
        return HEIGHT - 24 - (HEIGHT - 40) * (v - lo) / (hi - lo)

    lines = []
    for side, data in (("a", s.a), ("b", s.b)):
        points = " ".join(
            f"{x(st):.1f},{y(v):.1f}" for st, v in zip(s.steps, data) if v is not None and math.isfinite(v)
        )
        lines.append(f"<polyline class='{side}' fill='none' stroke-width='1.6' points='{points}'/>")
    mark = ""
    if first_step is not None and first <= first_step <= last:
        mark = f"<line class='part' x1='{x(first_step):.1f}' x2='{x(first_step):.1f}' y1='8' y2='{HEIGHT - 24}'/>"
    axis = (
        f"<text x='{PAD}' y='{HEIGHT - 6}' font-size='11'>step {first}</text>"
        f"<text x='{WIDTH - PAD}' y='{HEIGHT - 6}' font-size='11' text-anchor='end'>step {last}</text>"
        f"<text x='2' y='14' font-size='11'>{hi:.6g}</text><text x='2' y='{HEIGHT - 26}' font-size='11'>{lo:.6g}</text>"
    )
    return (
        f"<div class='chart'><h3>{e(title)}</h3><svg width='{WIDTH}' height='{HEIGHT}' "
        f"xmlns='http://www.w3.org/2000/svg'>{axis}{mark}{''.join(lines)}</svg></div>"
    )

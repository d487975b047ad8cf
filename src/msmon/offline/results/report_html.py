"""`msmon report`: one self-contained HTML page built from the database.

Everything the page needs is inside it: the CSS, the scripts (static/charts.js, agreement.js and
report.js, no library) and
the data as one JSON block. Nothing is fetched when it is viewed, so it can be mailed, attached
to an issue or opened on a machine without network. Its size is bounded by limits.Limits,
not by the size of the run.
"""

from __future__ import annotations

import html
import json
import os
from datetime import datetime
from importlib import resources
from typing import TYPE_CHECKING, Any

from ... import __version__
from .limits import Limits
from .queries import report_data

if TYPE_CHECKING:  # duckdb is optional and imported only where a database is opened
    from duckdb import DuckDBPyConnection

_ERROR_CAPTURE = """
window.__msmonErrors = [];
window.__msmonError = function (text) {
  window.__msmonErrors.push(String(text));
  var box = document.getElementById("msmon-errors");
  if (box) { box.style.display = "block"; box.textContent = "The report could not draw everything:\\n" + window.__msmonErrors.join("\\n"); }
  if (document.body) document.body.setAttribute("data-rendered", "error");
};
window.addEventListener("error", function (e) { window.__msmonError(e.message || String(e)); });
"""  # noqa: E501


def _static(name: str) -> str:
    return resources.files(__package__).joinpath("static").joinpath(name).read_text(encoding="utf-8")


def _script_json(data: dict[str, Any]) -> str:
    """JSON safe inside <script>: no `</`, no `<!--`, nothing a browser would end the block at."""
    text = json.dumps(data, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(data: dict[str, Any], title: str) -> str:
    """The page for report data (queries.report_data)."""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="msmon {html.escape(__version__)}">
<title>{html.escape(title)}</title>
<script>{_ERROR_CAPTURE}</script>
<style>{_static("report.css")}</style>
</head>
<body>
<header>
<h1>{html.escape(title)}</h1>
<div class="sub">{html.escape(_subtitle(data))}</div>
</header>
<div id="msmon-errors"></div>
<main>
<section id="overview"></section>
<div id="notes"></div>
<section id="loss-section"><h2>Loss per rank, as passed to backward</h2><div id="loss"></div></section>
<section id="anomalies-section"><h2>Anomalies</h2><div id="anomalies"></div></section>
<section id="agreement-section"><h2>Gradient agreement per rank</h2><div id="agreement"></div></section>
<section id="heatmaps-section"><h2>Statistics: tensors × steps</h2>
<p class="muted">One heatmap per category and op: a row per tensor in the order the monitor wrote them, a column per step;
the colour is the largest |value| over all ranks (and micro-steps), on a log scale of the heatmap's own range.
Hover a cell for its value and the rank that holds it; click a row for that tensor over steps, rank by rank.</p>
<div id="heatmaps"></div></section>
<section id="outliers-section"><h2>Per-rank outliers of rank-local tensors</h2><div id="outliers"></div></section>
<section id="spread-section"><h2>Spread across data-parallel ranks</h2><div id="spread"></div></section>
<section id="cost-section"><h2>The monitor's own cost</h2><div id="cost"></div></section>
</main>
<footer>msmon {html.escape(__version__)} · built {html.escape(data.get("generated", ""))} from {html.escape(data.get("database", ""))} ·
self-contained: no network is used to view this page.</footer>
<div id="tip"></div>
<script type="application/json" id="msmon-data">{_script_json(data)}</script>
<script>{_static("charts.js")}</script>
<script>{_static("agreement.js")}</script>
<script>{_static("report.js")}</script>
</body>
</html>
"""  # noqa: E501


def _subtitle(data: dict[str, Any]) -> str:
    roots = data.get("overview", {}).get("roots") or []
    where = ", ".join(roots) if roots else data.get("database", "")
    return f"{where} · generated {data.get('generated', '')}"


def build(
    con: DuckDBPyConnection,
    output: str,
    database: str,
    limits: Limits | None = None,
    title: str | None = None,
    tmp_dir: str | None = None,
) -> dict[str, Any]:
    """Write the report page of an open database to `output`; returns its data."""
    con.execute("SET enable_progress_bar = false")
    data = report_data(con, limits, tmp_dir)
    data["generated"] = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    data["database"] = database
    page = render(data, title or "msmon report")
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{output}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, output)
    data["bytes"] = len(page.encode("utf-8"))
    return data

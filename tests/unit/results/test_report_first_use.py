"""`msmon report` as a new user meets it: the page fits a 1280 px wide window (measured in headless
Chromium: no element past the window's width, the document no wider than it), the top movers
show where a fault began even when larger changes follow it, and the loss chart says its value is
what backward ran on. Numbers are checked against the CSV files written here."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import duckdb
import pytest
from test_report_ranks import browse, console, synthetic, with_script  # noqa: E402
from test_results_report import chromium  # noqa: E402

from msmon.offline.results import db, queries, report_html  # noqa: E402

ONSET, DIVERGES, STEPS, TENSORS = 15, 20, 30, 10


def noise(*key: int) -> float:
    """A deterministic value in [-1, 1)."""
    return math.sin(sum((i + 1) * 12.9898 * k for i, k in enumerate(key)) + 78.233) % 2.0 - 1.0


def gradient_norm(rank: int, tensor: int, step: int) -> float:
    """Healthy: a few % of noise per rank and step; rank 1 fed inputs x40 from ONSET on; from
    DIVERGES on, the training diverges: every tensor's gradient grows 100x every other step."""
    value = (1.0 + tensor) * (1.0 + 0.03 * noise(rank, tensor, step))
    if rank == 1 and step >= ONSET:
        value *= 40.0
    if step >= DIVERGES:
        value *= 100.0 ** ((step - DIVERGES) // 2 + 1)
    return value


def onset_run(out: Path) -> Path:
    for rank in (0, 1):
        directory = out / f"Dec01_10-00-00-rank{rank}-abcdef0{rank}"
        directory.mkdir(parents=True)
        for step in range(STEPS):
            rows = [f"0,layers.{t}.weight,{step},{gradient_norm(rank, t, step)!r}" for t in range(TENSORS)]
            (directory / f"grad_unreduced_{step}-{step}.csv").write_text(
                "vpp_stage,name,step,norm\n" + "\n".join(rows) + "\n"
            )
    return out


def test_the_top_movers_show_where_a_fault_began_though_larger_changes_follow(tmp_path):
    out = onset_run(tmp_path / "out")
    database = str(tmp_path / "run.duckdb")
    db.load([str(out)], database, progress=False)
    con = duckdb.connect(database, read_only=True)
    data = queries.report_data(con)
    con.close()
    movers = data["movers"]["grad_unreduced"]["norm"]
    # the divergence's changes (x100) are the largest ones and fill the list's usual length
    assert len([m for m in movers if abs(m["factor"]) > 90]) >= queries.Limits().movers
    (onset,) = [m for m in movers if m["first_unusual"]]
    assert (onset["from_step"], onset["step"]) == (ONSET - 1, ONSET)
    # the largest change at that step, and its numbers: rank 1's value after, the largest of rank 0 and 1 before
    changes = {
        t: max(gradient_norm(r, t, ONSET) for r in (0, 1)) / max(gradient_norm(r, t, ONSET - 1) for r in (0, 1))
        for t in range(TENSORS)
    }
    tensor = max(changes, key=lambda t: changes[t])
    assert onset["name"] == f"layers.{tensor}.weight" and onset["after_rank"] == 1
    assert onset["factor"] == pytest.approx(changes[tensor], rel=1e-6)
    assert not [m for m in movers if m["first_unusual"] is False and (m["from_step"], m["step"]) == (ONSET - 1, ONSET)]


def test_a_calm_run_has_no_first_unusual_change(tmp_path):
    out = tmp_path / "out"
    directory = out / "Dec01_10-00-00-rank0-abcdef00"
    directory.mkdir(parents=True)
    for step in range(STEPS):
        rows = [f"0,w{t},{step},{(1.0 + t) * (1.0 + 0.05 * noise(t, step))!r}" for t in range(4)]
        (directory / f"grad_unreduced_{step}-{step}.csv").write_text(
            "vpp_stage,name,step,norm\n" + "\n".join(rows) + "\n"
        )
    database = str(tmp_path / "run.duckdb")
    db.load([str(out)], database, progress=False)
    con = duckdb.connect(database, read_only=True)
    movers = queries.report_data(con)["movers"]["grad_unreduced"]["norm"]
    con.close()
    assert movers and not any(m["first_unusual"] for m in movers)


MEASURE = """
  document.querySelectorAll("details").forEach(function (d) { d.open = true; });
  setTimeout(function () {
    var width = document.documentElement.clientWidth, past = [];
    document.querySelectorAll("body *").forEach(function (e) {
      var box = e.getBoundingClientRect();
      if (e.offsetParent !== null && box.right > width + 0.5) past.push(e.tagName + "." + e.className + "#" + e.id);
    });
    var scrolled = document.documentElement.scrollWidth;
    document.body.setAttribute("data-fits", scrolled + "/" + width + "/" + past.slice(0, 8).join(","));
  }, 0);"""


@pytest.mark.browser
def test_the_page_fits_a_1280_px_window_and_the_loss_chart_says_what_its_value_is(tmp_path):
    """A run with NaN turns and a bad rank (the movers' widest rows) and the loss: the movers'
    table alone was 1302 px wide at 1280 before its cells could wrap."""
    browser = chromium()
    out = synthetic(tmp_path / "out", 6, 20, 40, "--loss", "--micro-steps", "2", "--bad-data")
    database = str(tmp_path / "run.duckdb")
    db.load([str(out)], database, progress=False)
    page = tmp_path / "report.html"
    con = duckdb.connect(database, read_only=True)
    report_html.build(con, str(page), database)
    con.close()
    measured = browse(
        browser,
        tmp_path / "profile",
        with_script(page, MEASURE, "measured.html"),
        "--window-size=1280,1000",
        "--dump-dom",
    )
    assert not console(measured), "\n".join(console(measured))
    body = re.search(r"<body[^>]*>", measured.stdout)
    assert body is not None and 'data-rendered="ok"' in body[0], measured.stderr[-2000:]
    fits = re.search(r'data-fits="(\d+)/(\d+)/([^"]*)"', body[0])
    assert fits is not None, body[0]
    scroll_width, client_width, past = int(fits[1]), int(fits[2]), fits[3]
    assert client_width <= 1280 and scroll_width <= client_width and past == "", (scroll_width, client_width, past)
    assert "Loss per rank, as passed to backward" in measured.stdout
    assert "The value each backward pass ran on" in measured.stdout
    data = json.loads(re.search(r'id="msmon-data">(.*?)</script>', page.read_text(), re.S)[1])
    assert data["loss"]["lines"]  # the chart the note is about was drawn from data

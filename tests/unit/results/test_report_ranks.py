"""`msmon report` across ranks: which rank holds each value, a heatmap row over steps rank by
rank (or as a band above 16 ranks), the loss per rank, the per-rank outliers of rank-local
tensors, non-finite turns in the top movers, and a page that does not grow with ranks. Every
number is checked against the CSV files read with Python's csv module and statistics computed
here."""

from __future__ import annotations

import base64
import csv
import json
import math
import os
import re
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from test_results_db import GENERATOR, csv_values  # noqa: E402
from test_results_report import chromium  # noqa: E402

from conftest import ROOT  # noqa: E402
from msmon.offline.analyse.reading import read_dumps  # noqa: E402
from msmon.offline.analyse.verdict import order_events, verdict  # noqa: E402
from msmon.offline.results import cells, db, queries, report_html  # noqa: E402

SPIKE_TENSOR = 2  # the generator's per_category // 3 with 8 tensors per category


def synthetic(out: Path, ranks: int, steps: int, tensors: int, *extra: str) -> Path:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = ["--ranks", str(ranks), "--steps", str(steps), "--tensors", str(tensors), "--processes", "2", *extra]
    subprocess.run([sys.executable, str(GENERATOR), "-o", str(out), *args], check=True, env=env, capture_output=True)
    return out


def load(out: Path, base: Path, limits: queries.Limits | None = None) -> tuple[str, dict]:
    database = str(base / "run.duckdb")
    db.load([str(out)], database, progress=False)
    con = duckdb.connect(database, read_only=True)
    data = queries.report_data(con, limits)
    con.close()
    return database, data


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """6 ranks (a line per rank), 2 micro-steps of loss, rank 1 fed bad data from step 8."""
    base = tmp_path_factory.mktemp("six")
    out = synthetic(base / "out", 6, 20, 40, "--loss", "--micro-steps", "2", "--bad-data")
    database, data = load(out, base)
    return out, database, data


@pytest.fixture(scope="module")
def forty(tmp_path_factory):
    """40 ranks: bands; rank 10 fed bad data from step 4, rank 20's spike at step 7, rank 30's NaN at step 9."""
    base = tmp_path_factory.mktemp("forty")
    out = synthetic(base / "out", 40, 12, 40, "--loss", "--bad-data")
    database, data = load(out, base)
    return out, database, data


def codes_of(text: str) -> list[int]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 2}H", raw))


def value_of(code: int, scale: dict) -> float:
    span = scale["hi"] - scale["lo"]
    return 10 ** (scale["lo"] + (code - cells.FIRST_LEVEL) / (cells.LAST_LEVEL - cells.FIRST_LEVEL) * span)


def per_rank(reference: dict, category: str, name: str, op: str = "norm") -> dict[tuple[int, int], list[float]]:
    """(rank, step) -> the values of every micro-step, from the CSV files."""
    out: dict[tuple[int, int], list[float]] = {}
    for (rank, _vpp, cat, tensor, step, _micro, o), value in reference.items():
        if cat == category and tensor == name and o == op:
            out.setdefault((rank, step), []).append(value)
    return out


def heatmap(data: dict, category: str, op: str = "norm") -> dict:
    return next(h for h in data["heatmaps"] if (h["category"], h["op"]) == (category, op))


def test_each_heatmap_cell_names_the_rank_that_holds_its_value(six):
    out, _, data = six
    reference = csv_values(out)
    columns = data["steps"]["columns"]
    for category in ("grad_unreduced", "actv", "grad_reduced"):
        h = heatmap(data, category)
        holders, codes = codes_of(h["ranks"]), codes_of(h["data"])
        for row, name in enumerate(h["rows"]):
            values = per_rank(reference, category, name)
            for step in range(20):
                here = {rank: v for (rank, s), vs in values.items() if s == step for v in vs}
                bad = sorted(rank for (rank, s), vs in values.items() if s == step and any(map(math.isnan, vs)))
                held = holders[row * columns + step]
                if bad:
                    assert codes[row * columns + step] == cells.NONFINITE and held == bad[0], (category, name, step)
                else:  # replicated tensors are equal on several ranks: any of them holds the max
                    assert abs(here[held]) == max(map(abs, here.values())), (category, name, step)


def test_a_row_chart_has_every_ranks_value_over_steps(six):
    out, _, data = six
    reference = csv_values(out)
    assert data["series"] == {
        "mode": "lines",
        "ranks": 6,
        "step_width": 1,
        "columns": 20,
        "line_ranks": [0, 1, 2, 3, 4, 5],
    }
    for category in ("grad_unreduced", "actv"):
        h = heatmap(data, category)
        series = h["series"]
        codes = codes_of(series["data"])
        assert series["lines"] == 6 and len(codes) == len(h["rows"]) * 6 * 20
        for row, name in enumerate(h["rows"]):
            values = per_rank(reference, category, name)
            for rank in range(6):
                for step in range(20):
                    code = codes[(row * 6 + rank) * 20 + step]
                    want = values[(rank, step)]
                    if any(map(math.isnan, want)):
                        assert code == cells.NONFINITE
                    else:
                        assert value_of(code, series) == pytest.approx(max(map(abs, want)), rel=1e-3)
    # rank 1's bad batches: 4x the others' unreduced gradient from step 8, and only there
    h = heatmap(data, "grad_unreduced")
    codes = codes_of(h["series"]["data"])
    row = 5
    ratio = [
        value_of(codes[(row * 6 + 1) * 20 + s], h["series"]) / value_of(codes[row * 120 + s], h["series"])
        for s in range(20)
    ]
    assert all(r < 1.2 for r in ratio[:8]) and all(r > 3 for r in ratio[8:])


def test_above_16_ranks_a_row_chart_is_the_min_median_max_band_and_the_ranks_that_depart(forty):
    out, _, data = forty
    reference = csv_values(out)
    assert data["series"]["mode"] == "band" and data["series"]["ranks"] == 40
    h = heatmap(data, "grad_unreduced")
    series = h["series"]
    codes = codes_of(series["data"])
    lines, columns = series["lines"], data["series"]["columns"]
    assert lines == 3 + 3 and columns == 12
    for row, name in enumerate(h["rows"]):
        values = per_rank(reference, "grad_unreduced", name)
        for step in range(12):
            at = [max(map(abs, values[(rank, step)])) for rank in range(40)]
            for line, want in enumerate((min(at), statistics.median(at), max(at))):
                got = value_of(codes[(row * lines + line) * columns + step], series)
                assert got == pytest.approx(want, rel=1e-3), (name, step, line)
        # the rank fed bad data departs from the median at every step from 4 on; the spike's
        # rank at one step, 50x, on its tensor
        assert 10 in series["outliers"][row], (name, series["outliers"][row])
        for j, rank in enumerate(series["outliers"][row]):
            for step in range(12):
                got = value_of(codes[(row * lines + 3 + j) * columns + step], series)
                assert got == pytest.approx(max(map(abs, values[(rank, step)])), rel=1e-3)
    assert series["outliers"][SPIKE_TENSOR][0] == 20
    # the NaN rank's activations: non-finite is the largest departure, and the band's max is non-finite there
    actv = heatmap(data, "actv")
    assert all(ranks[0] == 30 for ranks in actv["series"]["outliers"][4:])
    codes = codes_of(actv["series"]["data"])
    assert codes[(4 * lines + 2) * columns + 9] == cells.NONFINITE


def loss_values(out: Path) -> dict[tuple[int, int, int], float]:
    """(rank, step, micro-step) -> the loss, from the loss_*.csv files."""
    found = {}
    for path in out.glob("*-rank*/loss_*.csv"):
        rank = int(path.parent.name.split("-rank")[1].split("-")[0])
        with open(path, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                found[(rank, int(row["step"]), int(row["micro_step"]))] = float(row["value"])
    return found


def test_the_loss_chart_is_every_ranks_loss_per_micro_step_or_the_band_and_the_departing_ranks(six, forty):
    out, _, data = six
    loss = loss_values(out)
    chart = data["loss"]
    assert chart["mode"] == "lines" and chart["points"] == 40 and chart["micro_steps"] == 2
    assert chart["x"][:4] == [0.0, 0.5, 1.0, 1.5]
    for line in chart["lines"]:
        for i, got in enumerate(line["values"]):
            want = loss[(line["rank"], i // 2, i % 2)]
            assert got == ("nan" if math.isnan(want) else want), "the loss as recorded"
    assert [line["rank"] for line in chart["lines"]] == list(range(6))
    assert "loss" not in {h["category"] for h in data["heatmaps"]}, "the loss has its own chart"

    out, _, data = forty
    loss = loss_values(out)
    chart = data["loss"]
    assert chart["mode"] == "band" and chart["points"] == 12
    for step in range(12):
        finite = [v for k, v in loss.items() if k[1] == step and not math.isnan(v)]
        assert chart["band"]["median"][step] == pytest.approx(statistics.median(finite), rel=1e-12)
        assert (chart["band"]["min"][step], chart["band"]["max"][step]) == (min(finite), max(finite))
        assert chart["band"]["nonfinite"][step] == (1 if step >= 9 else 0)
    # the NaN rank first (a non-finite loss), then the rank fed bad data (3x the others' loss)
    assert [line["rank"] for line in chart["lines"][:2]] == [30, 10]


def robust_z_reference(values: list[float]) -> list[float]:
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return [abs(v - med) / max(1.4826 * mad, 1e-3 * abs(med), 1e-30) for v in values]


def test_the_per_rank_outliers_are_the_robust_z_of_rank_local_norms_over_ranks(six):
    out, _, data = six
    groups: dict[tuple, dict[int, float]] = {}
    for (rank, vpp, category, name, step, micro, op), value in csv_values(out).items():
        if category in ("actv", "actv_grad", "grad_unreduced") and op == "norm" and not math.isnan(value):
            groups.setdefault((category, vpp, name, step, micro), {})[rank] = value
    best: dict[tuple, tuple[float, int, int]] = {}
    for (category, vpp, name, step, _micro), by_rank in groups.items():
        if len(by_rank) < 3:
            continue
        ranks = sorted(by_rank)
        for rank, z in zip(ranks, robust_z_reference([by_rank[r] for r in ranks])):
            if z > best.get((category, vpp, name), (-1.0, 0, 0))[0]:
                best[(category, vpp, name)] = (z, rank, step)
    expected = sorted(best.items(), key=lambda kv: -kv[1][0])[:20]
    got = data["rank_outliers"]["top"]
    assert len(got) == len(expected) == 16, "8 activations and 8 unreduced gradients, all of them"
    for row, ((category, _vpp, name), (z, rank, step)) in zip(got, expected):
        assert (row["category"], row["name"], row["rank"], row["step"]) == (category, name, rank, step)
        assert row["z"] == pytest.approx(z, rel=1e-9)
    # rank 3's 50x spike at step 12 departs most on its tensor; rank 1, fed bad data, on every other
    spike = next(row for row in got if (row["category"], row["name"]) == ("grad_unreduced", "layers.0.mlp.fc1.weight"))
    assert (spike["rank"], spike["step"]) == (3, 12)
    assert {row["rank"] for row in got if row is not spike} == {1}


def test_top_movers_name_the_rank_and_list_a_turn_to_non_finite_first(six):
    out, _, data = six
    reference = csv_values(out)
    movers = data["movers"]["grad_reduced"]["norm"]
    flagged = [m for m in movers if m["factor"] is None]
    assert flagged and movers[: len(flagged)] == flagged, "flagged turns first"
    # generator: from step 16 (80 %) every reduced gradient is NaN on every rank
    for m in flagged:
        assert (m["from_step"], m["step"], m["after_nonfinite"], m["after"], m["after_rank"]) == (
            15,
            16,
            "nan",
            None,
            0,
        )
        before = {
            rank: v
            for (rank, _, c, n, s, _, o), v in reference.items()
            if (c, n, s, o) == ("grad_reduced", m["name"], 15, "norm")
        }
        assert m["before_rank"] == max(before, key=lambda r: abs(before[r])) and m["before"] == max(
            map(abs, before.values())
        )
    spike = next(m for m in data["movers"]["grad_unreduced"]["norm"] if m["step"] == 12)
    assert spike["after_rank"] == 3 and spike["before_nonfinite"] is None and spike["factor"] > 5


def test_the_verdict_is_analyse_and_its_kind_in_words_is_rank_1s_data_or_device(six):
    out, _, data = six
    ordered = order_events(read_dumps(str(out / "anomaly_detected")).events)
    # generator: rank 1 is fed bad batches from step 8, and its AnomalyRankOutlier record is the first
    # anomaly; the first tensor where it departs is a module's output (the generator records no input),
    # so that one step cannot tell its data from its device
    assert data["anomalies"]["verdict"] == verdict(ordered, set(range(6)))
    kind = data["anomalies"]["kind"]
    assert (kind["kind"], kind["code"], kind["rank"], kind["step"], kind["module"]) == (
        "one rank: its data or its device",
        "one_rank_data_or_device",
        1,
        8,
        "layers.0.attn.qkv",
    )


def test_a_512_rank_page_is_bounded_and_its_rank_charts_do_not_grow_with_ranks(tmp_path):
    """Bands, not 512 lines: the page is under 1 MB (the documented bound of the line charts is
    Limits.series_values, about 4 MB, for runs with many tensors and steps), and the line charts,
    the loss and the outlier table are as big at 512 ranks as at 32."""
    sizes, pages = {}, {}
    for ranks in (32, 512):
        base = tmp_path / str(ranks)
        out = synthetic(base / "out", ranks, 8, 10, "--window", "8", "--loss", "--bad-data")
        database = str(base / "run.duckdb")
        db.load([str(out)], database, progress=False)
        con = duckdb.connect(database, read_only=True)
        data = report_html.build(con, str(base / "report.html"), database)
        con.close()
        pages[ranks] = data["bytes"]
        assert data["series"]["mode"] == "band" and data["loss"]["mode"] == "band"
        assert len(data["loss"]["lines"]) == 3
        charts = [h["series"] for h in data["heatmaps"]] + [data["loss"], data["rank_outliers"]]
        sizes[ranks] = len(json.dumps(charts))
    assert pages[512] < 1_000_000, pages
    assert sizes[512] < 1.05 * sizes[32], sizes


SECTIONS = (
    "overview",
    "loss-section",
    "anomalies-section",
    "heatmaps-section",
    "outliers-section",
    "spread-section",
    "cost-section",
)


def click_row(category: str, row: int) -> str:
    """A script that clicks row `row` of the category's heatmap, as a user would (heatmaps of up
    to 40 rows draw rows 14 px high below a 20 px step axis)."""
    return f"""
      var cv = document.querySelector("#heat-{category} .heat canvas"), box = cv.getBoundingClientRect();
      cv.dispatchEvent(new MouseEvent("click",
        {{ clientX: box.left + 300, clientY: box.top + 20 + {row} * 14 + 7, bubbles: true }}));"""


def only(section: str) -> str:
    """A script that leaves one section on the page, for its screenshot."""
    return f"""
      document.querySelectorAll("main > section, #notes, header").forEach(function (s) {{
        if (s.id !== "{section}") s.style.display = "none"; }});
      if ("{section}" === "heatmaps-section") document.querySelectorAll("#heatmaps > div").forEach(function (s) {{
        if (s.id !== "heat-grad_unreduced") s.style.display = "none"; }});"""


def with_script(page: Path, script: str, name: str) -> Path:
    """A copy of the page with `script` run after the page's own (the test's click or layout)."""
    copy = page.with_name(name)
    copy.write_text(page.read_text(encoding="utf-8").replace("</body>", f"<script>{script}</script></body>"))
    return copy


def browse(browser: str, profile: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    flags = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
    ]
    return subprocess.run([*flags, *args, page.as_uri()], capture_output=True, text=True, timeout=120)


def console(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.browser
def test_the_page_draws_every_section_and_a_clicked_row_over_steps_in_headless_chromium(six, forty, tmp_path):
    browser = chromium()
    _, database, data = six
    page = tmp_path / "report.html"
    con = duckdb.connect(database, read_only=True)
    report_html.build(con, str(page), database)
    con.close()
    profile = tmp_path / "profile"
    dom = browse(browser, profile, page, "--dump-dom")
    assert not console(dom), "the page wrote to the console:\n" + "\n".join(console(dom))
    assert 'data-rendered="ok"' in re.search(r"<body[^>]*>", dom.stdout)[0], dom.stderr[-2000:]
    overview = dom.stdout[dom.stdout.index('<section id="overview">') :]
    assert overview.index('id="verdict"') < overview.index('class="cards"'), "the verdict first"
    assert 'id="loss-chart" data-lines="6" data-mode="lines"' in dom.stdout
    banner = overview[: overview.index('class="cards"')]
    assert 'data-code="one_rank_data_or_device" data-rank="1"' in banner
    assert (
        "Kind of fault: one rank: its data or its device</b> (step 8, rank 1, first module layers.0.attn.qkv)" in banner
    )
    assert dom.stdout.count("<tr>") > 16 + 8, "the outlier table's and the movers' rows"
    assert "(rank&nbsp;3)" in dom.stdout and "turned non-finite" in dom.stdout  # the movers keep "(rank 3)" on one line
    # a click on a heatmap row draws that tensor over steps, a line per rank
    clicked = browse(browser, profile, with_script(page, click_row("grad_unreduced", 2), "clicked.html"), "--dump-dom")
    assert not console(clicked), "\n".join(console(clicked))
    assert 'data-shown="grad_unreduced/norm/2"' in clicked.stdout
    assert '<div class="row-chart" data-row="2" data-lines="6" data-mode="lines">' in clicked.stdout
    assert f"grad_unreduced norm · {heatmap(data, 'grad_unreduced')['rows'][2]}" in clicked.stdout
    # a screenshot per section (the heatmap one with the clicked row's chart under it)
    for section in SECTIONS:
        script = only(section) + (click_row("grad_unreduced", 2) if section == "heatmaps-section" else "")
        shot = tmp_path / f"{section}.png"
        browse(
            browser,
            profile,
            with_script(page, script, f"{section}.html"),
            "--hide-scrollbars",
            "--window-size=1400,1000",
            f"--screenshot={shot}",
        )
        assert shot.is_file() and shot.stat().st_size > 15_000, f"{section}: a drawn section, not a blank page"
        print(f"screenshot: {shot}")
    # above 16 ranks the clicked row is the band, its median and the ranks that depart
    _, database, _ = forty
    wide = tmp_path / "wide.html"
    con = duckdb.connect(database, read_only=True)
    report_html.build(con, str(wide), database)
    con.close()
    clicked = browse(
        browser, profile, with_script(wide, click_row("grad_unreduced", 2), "wide-clicked.html"), "--dump-dom"
    )
    assert not console(clicked), "\n".join(console(clicked))
    assert '<div class="row-chart" data-row="2" data-lines="5" data-mode="band">' in clicked.stdout
    assert 'id="loss-chart" data-lines="4" data-mode="band"' in clicked.stdout
    shot = tmp_path / "band.png"
    browse(
        browser,
        profile,
        with_script(wide, only("heatmaps-section") + click_row("grad_unreduced", 2), "wide-shot.html"),
        "--hide-scrollbars",
        "--window-size=1400,1000",
        f"--screenshot={shot}",
    )
    assert shot.is_file() and shot.stat().st_size > 15_000
    print(f"screenshot: {shot}")


def test_a_long_run_averages_the_loss_and_merges_the_row_charts_steps_within_their_budget(six):
    out, database, _ = six
    con = duckdb.connect(database, read_only=True)
    data = queries.report_data(con, queries.Limits(loss_points=10, series_values=35 * 8 * 6 * 10))
    con.close()
    chart = data["loss"]
    assert (chart["points"], chart["step_width"], chart["x"][:3]) == (10, 2, [0.0, 2.0, 4.0])
    loss = loss_values(out)
    for line in chart["lines"]:
        for point, got in enumerate(line["values"]):
            merged = [v for (r, s, _), v in loss.items() if r == line["rank"] and s // 2 == point]
            # the mean of the merged losses; non-finite where any of them was
            assert got == (
                "nan" if any(map(math.isnan, merged)) else pytest.approx(statistics.fmean(merged), rel=1e-12)
            )
    # 35 heatmaps of 8 rows of 6 ranks' lines over 20 steps is twice the budget: two steps per point
    assert (data["series"]["step_width"], data["series"]["columns"]) == (2, 10)
    h = heatmap(data, "grad_unreduced")
    codes = codes_of(h["series"]["data"])
    reference = per_rank(csv_values(out), "grad_unreduced", h["rows"][0])
    for rank in range(6):
        for point in range(10):
            want = max(abs(v) for s in (2 * point, 2 * point + 1) for v in reference[(rank, s)])
            assert value_of(codes[rank * 10 + point], h["series"]) == pytest.approx(want, rel=1e-3)

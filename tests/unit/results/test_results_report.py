"""`msmon report`: the numbers on the page, checked against the CSV files and the dumps read
independently, the page's bounds, and the page itself opened in headless Chromium."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import statistics
import struct
import subprocess

import duckdb
import pytest
from click.testing import CliRunner
from test_results_db import SYNTHETIC_OPS, csv_values, make_synthetic  # noqa: E402

from conftest import ROOT  # noqa: E402
from msmon.launcher.cli import main  # noqa: E402
from msmon.offline.analyse.reading import read_dumps  # noqa: E402
from msmon.offline.analyse.verdict import order_events, verdict  # noqa: E402
from msmon.offline.results import cells, db, queries, report_html  # noqa: E402
from msmon.records.rows import REPLICATED_CATEGORIES  # noqa: E402

ARTIFACTS = ROOT / "tests" / "artifacts"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A small synthetic run (4 ranks, 20 steps, 40 tensors) and its database."""
    base = tmp_path_factory.mktemp("report")
    out = make_synthetic(base / "out", ranks=4, steps=20, tensors=40)
    database = str(base / "run.duckdb")
    db.load([str(out)], database, progress=False)
    con = duckdb.connect(database, read_only=True)
    data = queries.report_data(con)
    con.close()
    return out, database, data


def decode(heatmap: dict) -> list[int]:
    raw = base64.b64decode(heatmap["data"])
    return list(struct.unpack(f"<{len(raw) // 2}H", raw))


def cell_value(code: int, heatmap: dict) -> float:
    span = heatmap["hi"] - heatmap["lo"]
    return 10 ** (heatmap["lo"] + (code - cells.FIRST_LEVEL) / (cells.LAST_LEVEL - cells.FIRST_LEVEL) * span)


def test_a_heatmap_cell_is_the_largest_value_over_ranks_and_non_finite_shows_as_such(run):
    out, _, data = run
    reference = csv_values(out)
    heat = {(h["category"], h["op"]): h for h in data["heatmaps"]}
    assert set(heat) == {
        (c, op) for c in ("actv", "grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq") for op in SYNTHETIC_OPS
    }
    norm = heat[("grad_unreduced", "norm")]
    codes = decode(norm)
    columns = data["steps"]["columns"]
    assert data["steps"] == {"first_step": 0, "step_width": 1, "columns": 20}
    assert len(codes) == len(norm["rows"]) * columns and len(norm["rows"]) == 8
    for row, name in enumerate(norm["rows"]):
        for step in range(20):
            want = max(
                abs(v)
                for k, v in reference.items()
                if k[2] == "grad_unreduced" and k[3] == name and k[4] == step and k[6] == "norm"
            )
            got = cell_value(codes[row * columns + step], norm)
            assert got == pytest.approx(want, rel=1e-3), (name, step)
    actv = heat[("actv", "norm")]
    with open(sorted(out.glob("*-rank0-*/actv_0-0.csv"))[0], encoding="utf-8") as fh:
        written = [line.split(",")[1] for line in fh.read().splitlines()[1:]]
    assert actv["rows"] == written, "rows in the order the monitor wrote them"
    codes = decode(actv)
    for row, name in enumerate(actv["rows"]):
        for step in range(20):
            bad = any(
                math.isnan(v)
                for k, v in reference.items()
                if k[2] == "actv" and k[3] == name and k[4] == step and k[6] == "norm"
            )
            assert (codes[row * columns + step] == cells.NONFINITE) == bad, (name, step)
    assert cells.NONFINITE in codes, "the synthetic run's NaN shows"


def test_the_injected_spike_is_the_top_mover_and_the_desynchronised_rank_tops_the_spread(run):
    out, _, data = run
    top = data["movers"]["grad_unreduced"]["norm"][0]
    # generator: at step 12 (60 %) rank 2 has its unreduced gradient of tensor 8 // 3 = 2 grown 50x
    assert top["name"] == "layers.0.mlp.fc1.weight" and {top["from_step"], top["step"]} <= {11, 12, 13}
    assert abs(top["factor"]) > 20
    spread = data["spread"]
    assert spread["top"] and all(t["category"] in REPLICATED_CATEGORIES for t in spread["top"])
    first = spread["top"][0]
    # generator: from step 10 rank 4 // 3 = 1 drifts by 1e-3; before that every rank agrees
    assert 1 in (first["min_rank"], first["max_rank"]) and first["ranks"] == 4
    assert all(t["step"] >= 10 for t in spread["top"])
    reference = csv_values(out)
    values = [
        v
        for k, v in reference.items()
        if k[2:5] == (first["category"], first["name"], first["step"]) and k[6] == first["op"]
    ]
    assert first["spread"] == pytest.approx(max(values) - min(values))


def test_the_anomaly_section_is_msmon_analyse_verdict(run):
    out, _, data = run
    ordered = order_events(read_dumps(str(out / "anomaly_detected")).events)
    anomalies = data["anomalies"]
    assert anomalies["total"] == len(ordered)
    assert anomalies["verdict"] == verdict(ordered, set(range(4)))
    assert anomalies["origin"]["rule"] == "NanOrigin" and anomalies["origin"]["rank"] == 3
    assert [e["description"] for e in anomalies["first"]] == [e.to_json()["description"] for e in ordered[:20]]


def test_the_cost_section_is_each_ranks_summary(run):
    out, _, data = run
    summaries = [json.loads(p.read_text()) for p in sorted(out.glob("*-rank*/summary.json"))]
    cost = data["cost"]
    assert cost["ranks"] == 4
    assert cost["stats"]["monitor_cost_pct"]["median"] == pytest.approx(
        statistics.median(s["monitor_cost_pct"] for s in summaries)
    )
    assert cost["top"][0]["rank"] == max(summaries, key=lambda s: s["monitor_cost_pct"])["rank"]


def test_a_big_run_makes_a_bounded_page_that_says_what_was_merged(tmp_path):
    out = make_synthetic(tmp_path / "out", ranks=2, steps=150, tensors=200, window=50)
    database = str(tmp_path / "run.duckdb")
    db.load([str(out)], database, progress=False)
    con = duckdb.connect(database, read_only=True)
    limits = queries.Limits(max_steps=40, max_rows=16)
    page = str(tmp_path / "report.html")
    data = report_html.build(con, page, database, limits)
    con.close()
    assert data["steps"] == {"first_step": 0, "step_width": 4, "columns": 38}
    for heatmap in data["heatmaps"]:
        assert len(heatmap["rows"]) <= 16 and len(decode(heatmap)) <= 16 * 40
        assert heatmap["tensors"] == 40 and heatmap["tensors_per_row"] == 3
    assert "layers.0.attn.qkv.output … layers.0.mlp.fc1.output (3)" in data["heatmaps"][0]["rows"][0]
    assert data["bytes"] < 400_000


def test_the_page_is_self_contained(run, tmp_path):
    _, database, _ = run
    page = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", "--db", database, "-o", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text), "nothing is fetched at view time"
    assert "<link" not in text and "@import" not in text and "fetch(" not in text
    data = json.loads(re.search(r'<script type="application/json" id="msmon-data">(.*?)</script>', text, re.S)[1])
    assert len(data["heatmaps"]) == 35


def test_msmon_report_loads_a_directory_itself_and_wants_a_source(run, tmp_path):
    out, _, _ = run
    page = tmp_path / "direct.html"
    result = CliRunner().invoke(main, ["report", "-d", str(out), "-o", str(page), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert page.is_file() and "35 heatmaps" in result.output
    bare = CliRunner().invoke(main, ["report", "-o", str(page)])
    assert bare.exit_code == 2 and "-d" in bare.output
    missing = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "none.duckdb"), "-o", str(page)])
    assert missing.exit_code == 1 and "no database at" in missing.output


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail(
            "headless Chromium is needed for this test and was not found: apt-get install -y chromium "
            "(.ci/run installs it)"
        )
    return found


@pytest.mark.browser
def test_the_page_renders_in_headless_chromium_without_errors(run, tmp_path):
    browser = chromium()
    _, database, data = run
    page = tmp_path / "report.html"
    con = duckdb.connect(database, read_only=True)
    report_html.build(con, str(page), database)
    con.close()
    flags = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
    ]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    body = re.search(r"<body[^>]*>", dom.stdout)
    assert body, f"no page came back: {dom.stderr[-2000:]}"
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, "the page wrote to the console:\n" + "\n".join(console)
    assert 'data-rendered="ok"' in body[0], f"{body[0]}\n{dom.stderr[-2000:]}"
    assert f'data-heatmaps="{len(data["heatmaps"])}"' in body[0]
    assert dom.stdout.count("<canvas") >= 5 + 1 + 1, "heatmaps, timeline and cost chart are drawn"
    shot = tmp_path / "report.png"
    subprocess.run(
        flags + ["--hide-scrollbars", "--window-size=1400,2400", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.is_file() and shot.stat().st_size > 20_000, "a screenshot of the drawn page"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "report.png")
    print(f"screenshot: {ARTIFACTS / 'report.png'}")
    # a run that recorded nothing (one summary, no statistics, no dump) still draws its page
    empty = tmp_path / "empty" / "Dec03_10-00-00-rank0-0000abcd"
    empty.mkdir(parents=True)
    (empty / "summary.json").write_text(json.dumps({"rank": 0, "steps_recorded": 0, "alerts": 0}))
    empty_db = str(tmp_path / "empty.duckdb")
    db.load([str(tmp_path / "empty")], empty_db, progress=False)
    con = duckdb.connect(empty_db, read_only=True)
    report_html.build(con, str(tmp_path / "empty.html"), empty_db)
    con.close()
    dom = subprocess.run(
        flags + ["--dump-dom", (tmp_path / "empty.html").as_uri()], capture_output=True, text=True, timeout=120
    )
    assert 'data-rendered="ok"' in dom.stdout and "No statistics in the database" in dom.stdout, dom.stderr[-2000:]
    assert not [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]

"""What `msmon diff` writes: the JSON answer, the `diff` tables in DuckDB, the golden file of
--calibrate, and the page with the tensors that part most (drawn in headless Chromium)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from diff_outputs import base_value, changed, write_output
from msmon.launcher.cli import main


def diff(*args):
    return CliRunner().invoke(main, ["diff", *map(str, args)])


def test_the_json_answer_has_first_divergence_and_the_front_and_null_when_identical(tmp_path):
    a = write_output(tmp_path / "a")
    answer = tmp_path / "answer.json"
    assert diff(a, write_output(tmp_path / "same"), "--json", answer).exit_code == 0
    data = json.loads(answer.read_text())
    assert data["first_divergence"] is None and data["identical"] and data["exit_code"] == 0
    assert [row["over"] for row in data["front"]] == [0, 0, 0]
    assert diff(a, write_output(tmp_path / "b", value=changed("actv_grad", "fc1.input_grad", 1)), "--json", answer)
    data = json.loads(answer.read_text())
    first = data["first_divergence"]
    assert set(first) >= {"step", "category", "name", "module", "op", "a", "b", "relative_difference", "tolerance"}
    assert (first["step"], first["module"], first["micro_step"]) == (1, "fc1", 0)
    row = data["front"][1]
    assert row["categories"]["actv_grad"]["tensors_over"] == 1 and row["tensors_over"] == 1
    assert row["largest"]["name"] == "fc1.input_grad" and data["exit_code"] == 1


def test_the_diff_tables_in_duckdb_hold_every_value_that_differs_and_the_front(tmp_path):
    import duckdb

    a = write_output(tmp_path / "a")
    b = write_output(tmp_path / "b", value=changed("exp_avg", "fc2.weight", 1, factor=1.0001))
    database = tmp_path / "diff.duckdb"
    result = diff(a, b, "--db", database)
    assert result.exit_code == 1 and "table diff: 16 values that differ" in result.stderr, result.output
    con = duckdb.connect(str(database), read_only=True)
    rows = con.execute("SELECT step, rank, category, name, op, over FROM diff ORDER BY step, rank, op").fetchall()
    assert {(s, r, c, n) for s, r, c, n, _, _ in rows} == {
        (s, r, "exp_avg", "fc2.weight") for s in (1, 2) for r in (0, 1)
    }
    assert all(over for *_, op, over in rows if op == "norm")
    front = con.execute("SELECT step, over FROM diff_front WHERE category = 'exp_avg' ORDER BY step").fetchall()
    assert front == [(0, 0), (1, 2), (2, 2)]
    first = json.loads(con.execute("SELECT value FROM diff_info WHERE key = 'first_divergence'").fetchone()[0])
    assert first["step"] == 1 and first["name"] == "fc2.weight"
    con.close()
    assert diff(a, b, "--db", database).exit_code == 1  # its own file: replaced
    other = tmp_path / "run.duckdb"
    duckdb.connect(str(other)).execute("CREATE TABLE metrics (x INTEGER)").close()
    refused = diff(a, b, "--db", other)
    assert refused.exit_code == 2 and "msmon diff did not write it" in refused.stderr


def test_calibration_learns_the_largest_difference_of_reruns_and_checks_a_new_run_against_it(tmp_path):
    reruns = [
        write_output(tmp_path / f"r{i}", value=changed("actv", "fc2.output", 0, factor=1 + i * 2e-5)) for i in range(3)
    ]
    golden = tmp_path / "golden.json"
    result = diff("--calibrate", *reruns, "-o", golden)
    assert result.exit_code == 0, result.output
    data = json.loads(golden.read_text())
    assert data["observed"]["actv"]["norm"] == pytest.approx(4e-5, rel=0.05)
    assert data["tolerances"]["actv"]["norm"] == pytest.approx(6e-5, rel=0.05)
    assert data["tolerances"]["grad_reduced"]["norm"] == pytest.approx(1e-5)  # nothing seen: the floor
    near = write_output(tmp_path / "near", value=changed("actv", "fc2.output", 0, factor=1 + 5e-5))
    far = write_output(tmp_path / "far", value=changed("actv", "fc2.output", 2, factor=1 + 1e-4))
    assert diff(golden, near).exit_code == 0
    parted = diff(golden, far)
    assert parted.exit_code == 1 and "parted at step 2: forward output of fc2" in parted.stdout
    assert "tolerance: calibrated from" in parted.stdout
    refused = diff(golden, near, "--rtol", "1e-3")
    assert refused.exit_code == 2 and "brings its own tolerances" in refused.stderr
    assert diff(near, golden).exit_code == 2
    same = diff("--calibrate", reruns[0], reruns[0], "-o", tmp_path / "same.json")
    assert same.exit_code == 0 and "identical bit for bit: the tolerance is the floor" in same.stdout


@pytest.mark.browser
def test_the_page_draws_the_twenty_tensors_that_part_most_as_two_lines_over_steps_in_headless_chromium(tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        pytest.fail("headless Chromium is needed for this test: apt-get install -y chromium (.ci/run installs it)")

    def drifting(c, n, s, r, m):  # from step 2 every tensor drifts, each by its own amount
        base = base_value(c, n, s, r, m)
        return base * (1 + 1e-3 * (len(n) + len(c)) * (s - 1)) if s >= 2 else base

    a = write_output(tmp_path / "a", steps=6, blocks=10)
    page = tmp_path / "diff.html"
    result = diff(a, write_output(tmp_path / "b", steps=6, value=drifting, blocks=10), "--html", page)
    assert result.exit_code == 1, result.output
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
    ]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert "<body" in dom.stdout, dom.stderr[-2000:]
    assert not [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    charts = re.findall(r"<div class=\"chart\">.*?</div>", dom.stdout, re.S)
    assert len(charts) == 20  # 28 tensors part: the 20 that part most
    for chart in charts:
        lines = re.findall(r"<polyline class=\"([ab])\"[^>]*points=\"([^\"]+)\"", chart)
        assert [side for side, _ in lines] == ["a", "b"]
        assert all(len(points.split()) == 6 for _, points in lines), "one point per step on each side"
        assert 'class="part"' in chart  # the first step over the tolerance, marked
    assert "parted at step 2" in dom.stdout and 'id="front"' in dom.stdout
    shot = tmp_path / "diff.png"
    subprocess.run(
        flags + ["--hide-scrollbars", "--window-size=1300,1800", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.is_file() and shot.stat().st_size > 20_000


def test_a_rerun_that_turns_non_finite_gives_an_infinite_tolerance_written_as_text_not_a_crash(tmp_path):
    def nan_at_2(c, n, s, r, m):
        return float("nan") if (c, n, s) == ("actv", "fc2.output", 2) else base_value(c, n, s, r, m)

    golden = tmp_path / "golden.json"
    reruns = [write_output(tmp_path / "r1"), write_output(tmp_path / "r2", value=nan_at_2)]
    result = diff("--calibrate", *reruns, "-o", golden)
    assert result.exit_code == 0, result.output
    data = json.loads(golden.read_text())
    assert data["tolerances"]["actv"]["norm"] == "inf" and data["observed"]["actv"]["norm"] == "inf"
    assert diff(golden, reruns[1]).exit_code == 0

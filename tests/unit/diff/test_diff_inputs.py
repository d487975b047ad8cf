"""`msmon diff`'s inputs: output directories and their runs, msprobe's output, databases from
`msmon db`, TensorBoard-only output, --map; and bad input, which is one line and exit 2, never a
traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from click.testing import CliRunner

from conftest import ROOT
from diff_outputs import changed, write_output
from msmon.launcher.cli import main


def diff(*args) -> CliRunner:
    return CliRunner().invoke(main, ["diff", *map(str, args)])


def assert_one_line_and_exit_2(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("msmon diff: "), result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], lines[0]


def test_a_missing_directory_is_one_line_and_exit_2(tmp_path):
    a = write_output(tmp_path / "a")
    assert_one_line_and_exit_2(diff(a, tmp_path / "nowhere"), "nowhere", "no such directory or file")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_and_exit_2(diff(empty, a), "no statistics")


def test_a_run_id_that_does_not_exist_is_one_line_that_lists_the_runs_and_exit_2(tmp_path):
    a = write_output(tmp_path / "a")
    assert_one_line_and_exit_2(diff(a, a, "--run-b", "19990101"), "--run 19990101: no run with that id", "20261206")


def test_a_corrupt_csv_line_names_its_file_and_line_and_exits_2_whether_or_not_its_pair_is_the_same(tmp_path):
    a, b = write_output(tmp_path / "a"), write_output(tmp_path / "b")
    for side in (a, b):  # the same bytes on both sides: found when the pair is counted
        (path,) = side.glob("*-rank1-*/actv_1-1.csv")
        lines = path.read_text().splitlines()
        lines[2] = lines[2].replace(",", ";", 2)
        path.write_text("\n".join(lines) + "\n")
    assert_one_line_and_exit_2(diff(a, b), "actv_1-1.csv line 3", "cells where the header has")
    (path,) = b.glob("*-rank0-*/grad_reduced_2-2.csv")
    path.write_text(path.read_text().replace("fc2.weight,2,", "fc2.weight,2,abc,"))
    (bad_a,) = a.glob("*-rank1-*/actv_1-1.csv")
    shutil.copy(next(b.glob("*-rank1-*/actv_1-1.csv")), bad_a)
    result = diff(a, b)
    assert_one_line_and_exit_2(result, "grad_reduced_2-2.csv line 3")


def test_a_line_still_being_written_is_left_out_not_called_corrupt(tmp_path):
    a, b = write_output(tmp_path / "a"), write_output(tmp_path / "b")
    (path,) = b.glob("*-rank0-*/exp_avg_2-2.csv")
    text = path.read_text()
    path.write_text(text[: text.rindex("\n", 0, -1) + 1] + "0,fc2.weight,2,0.12")  # no newline yet
    result = diff(a, b)
    assert result.exit_code == 0, result.output
    assert "identical over 3 steps x 18 tensors" in result.stdout and "1 rows only on one side" in result.stdout


def test_a_corrupt_or_foreign_database_is_one_line_and_exit_2(tmp_path):
    a = write_output(tmp_path / "a")
    garbage = tmp_path / "run.duckdb"
    garbage.write_bytes(b"\x00" * 100)
    assert_one_line_and_exit_2(diff(a, garbage), "run.duckdb", "not a DuckDB database")
    import duckdb

    foreign = tmp_path / "foreign.duckdb"
    duckdb.connect(str(foreign)).execute("CREATE TABLE t (x INTEGER)").close()
    assert_one_line_and_exit_2(diff(a, foreign), "not one msmon db wrote")


def test_bad_map_files_and_misplaced_options_are_one_line_and_exit_2(tmp_path):
    a = write_output(tmp_path / "a")
    bad = tmp_path / "names.json"
    bad.write_text('{"fc1": 3}')
    assert_one_line_and_exit_2(diff(a, a, "--map", bad), "--map", "substring in A")
    bad.write_text("{not json")
    assert_one_line_and_exit_2(diff(a, a, "--map", bad), "not valid JSON")
    assert_one_line_and_exit_2(diff(a), "expected two inputs")
    assert_one_line_and_exit_2(diff(a, a, "--exact", "--rtol", "1e-3"), "choose one")
    assert_one_line_and_exit_2(diff("--calibrate", a, a), "-o golden.json")


def test_two_runs_in_one_directory_are_told_apart_by_run_a_and_run_b(tmp_path):
    out = tmp_path / "out"
    write_output(out, run_id="20261206-100000-aaaaaa", time="Dec06_10-00-00")
    write_output(
        out, run_id="20261206-110000-bbbbbb", time="Dec06_11-00-00", value=changed("grad_reduced", "fc1.weight", 1)
    )
    result = diff(out, out, "--run-a", "20261206-10", "--run-b", "20261206-11")
    assert result.exit_code == 1, result.output
    assert "run 20261206-100000-aaaaaa" in result.stdout and "run 20261206-110000-bbbbbb" in result.stdout
    assert "parted at step 1: reduced gradient of fc1.weight" in result.stdout
    assert diff(out, out, "--run-a", "20261206-11").exit_code == 0  # the newest against itself


def test_msprobe_output_without_run_config_or_summary_is_compared_and_its_job_facts_are_unknown(tmp_path):
    a = write_output(tmp_path / "a", msprobe=True)
    b = write_output(tmp_path / "b", msprobe=True, value=changed("actv", "fc2.output", 2, rank=1))
    result = diff(a, b)
    assert result.exit_code == 1, result.output
    assert "unknown: A and B state no job facts" in result.stdout
    assert "parted at step 2: forward output of fc2 (step 2, micro-step 0, rank 1)" in result.stdout
    assert "numerics in fc2's forward" in result.stdout


def test_a_database_msmon_db_wrote_compares_like_the_directory_it_was_loaded_from(tmp_path):
    import duckdb  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)

    a = write_output(tmp_path / "a")
    b = write_output(tmp_path / "b", value=changed("exp_avg", "fc2.weight", 1, factor=1.01))
    database = tmp_path / "b.duckdb"
    assert CliRunner().invoke(main, ["db", "-d", str(b), "-o", str(database), "--no-progress"]).exit_code == 0
    from_dir, from_db = tmp_path / "dir.json", tmp_path / "db.json"
    assert diff(a, b, "--json", from_dir).exit_code == 1
    assert diff(a, database, "--json", from_db).exit_code == 1
    first_dir, first_db = (json.loads(p.read_text())["first_divergence"] for p in (from_dir, from_db))
    assert first_db == first_dir and first_db["category"] == "exp_avg" and first_db["step"] == 1
    assert (
        json.loads(from_db.read_text())["compared"]["values"] == json.loads(from_dir.read_text())["compared"]["values"]
    )
    assert_one_line_and_exit_2(diff(a, database, "--run-b", "1999"), "holds run 20261206-100000-aaaaaa")


def test_tensorboard_output_is_read_from_its_event_files(tmp_path):
    a = write_output(tmp_path / "a")
    tb = tmp_path / "tb"
    converted = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "convert", "csv2tb", "-d", str(a), "-o", str(tb), "--float32"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
    )
    assert converted.returncode == 0, converted.stderr
    result = diff(a, tb)
    assert result.exit_code == 0, result.output
    assert "within tolerance over 3 steps x 18 tensors" in result.stdout or "identical" in result.stdout
    assert "2.4e-07" in result.stdout or "1e-05" in result.stdout  # the floor of float32 scalars and CSV digits


def test_map_rewrites_a_names_into_b_names_and_different_models_are_refused(tmp_path):
    a = write_output(tmp_path / "a")
    renamed = tmp_path / "b"
    shutil.copytree(a, renamed)
    for path in renamed.rglob("*.csv"):
        path.write_text(path.read_text().replace("fc1.", "linear1."))
    assert_one_line_and_exit_2(diff(a, renamed), "different models: 1 of 3 weights in common", "--map")
    names = tmp_path / "names.json"
    names.write_text(json.dumps({"fc1.": "linear1."}))
    result = diff(a, renamed, "--map", names)
    assert result.exit_code == 0 and "identical over 3 steps x 18 tensors" in result.stdout, result.output
    other = tmp_path / "other"
    shutil.copytree(a, other)
    for path in other.rglob("*.csv"):
        path.write_text(path.read_text().replace("fc", "conv"))
    assert_one_line_and_exit_2(diff(a, other), "record no tensor in common")

"""`msmon diff` over the `parquet` format's files (records/parquet_layout.py), written by `msmon
export --to parquet` from small hand-made CSV outputs: a Parquet-only output, a CSV-only one and
one of both formats give the same answer as the CSV; the rows read back are the CSV's; a damaged
`*.parquet` file is named and left out as `msmon db` leaves it out; a `.part-*.parquet.tmp` file
is never read; a catalog `msmon db` built over Parquet files is read through its `metrics` view;
--run-a/--run-b choose a `run=<id>` folder; --calibrate learns the same tolerances."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)
import pyarrow  # noqa: F401  (in msmon[test]: missing, the test fails, never skips)
import pytest
from click.testing import CliRunner

from diff_outputs import base_value, changed, write_output  # noqa: E402
from msmon.launcher.cli import main  # noqa: E402
from msmon.offline.diff import csv_rows, parquet_rows  # noqa: E402
from msmon.offline.diff.inputs import open_input  # noqa: E402

RUN = "20261206-100000-aaaaaa"
SAME_EXCEPT = ("a", "b")  # the inputs' paths; files_identical: CSV files counted by their bytes


def msmon(*args: str | Path) -> str:
    result = CliRunner().invoke(main, [*map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def both_formats(root: Path, **options) -> Path:
    """A CSV output with the same rows exported beside it as Parquet files (`format: ["csv", "parquet"]`)."""
    write_output(root, **options)
    msmon("export", "-d", root, "--to", "parquet", "--roll-steps", "2")
    return root


def csv_only(out: Path, into: Path) -> Path:
    return Path(shutil.copytree(out, into, ignore=shutil.ignore_patterns("parquet")))


def parquet_only(out: Path, into: Path) -> Path:
    return Path(shutil.copytree(out, into, ignore=shutil.ignore_patterns("*.csv")))


def answer(tmp_path: Path, a: Path, b: Path, *args: str) -> tuple[int, dict, str]:
    path = tmp_path / "answer.json"
    result = CliRunner().invoke(main, ["diff", str(a), str(b), "--json", str(path), *args])
    assert result.exit_code in (0, 1), result.output
    data = json.loads(path.read_text())
    for key in SAME_EXCEPT:
        data.pop(key)
    data["compared"].pop("files_identical")
    return result.exit_code, data, result.output


@pytest.fixture
def outputs(tmp_path) -> dict[str, Path]:
    """Two runs of both formats (B's fc2 output times 1.001 on rank 1 from step 1), and each as
    a CSV-only and a Parquet-only copy."""
    a = both_formats(tmp_path / "a", steps=4, micro_steps=2)
    b = both_formats(tmp_path / "b", steps=4, micro_steps=2, value=changed("actv", "fc2.output", 1, rank=1))
    return {
        "a": a,
        "b": b,
        "a_csv": csv_only(a, tmp_path / "a_csv"),
        "b_csv": csv_only(b, tmp_path / "b_csv"),
        "a_pq": parquet_only(a, tmp_path / "a_pq"),
        "b_pq": parquet_only(b, tmp_path / "b_pq"),
    }


def test_parquet_only_mixed_and_both_formats_outputs_give_the_csv_answer_verdict_first_divergence_and_counts(
    outputs, tmp_path
):
    code, expected, printed = answer(tmp_path, outputs["a_csv"], outputs["b_csv"])
    assert code == 1 and expected["first_divergence"]["name"] == "fc2.output"
    assert (expected["first_divergence"]["step"], expected["first_divergence"]["rank"]) == (1, 1)
    result_line = next(line for line in printed.splitlines() if line.startswith("result:"))
    for a, b in (("a_pq", "b_pq"), ("a_csv", "b_pq"), ("a_pq", "b_csv"), ("a", "b")):
        code_ab, data, printed_ab = answer(tmp_path, outputs[a], outputs[b])
        assert (code_ab, data) == (code, expected), (a, b)
        assert result_line in printed_ab
    same, data, _ = answer(tmp_path, outputs["a_pq"], outputs["a_csv"], "--exact")
    assert same == 0 and data["identical"] and data["compared"]["values"] == expected["compared"]["values"]
    pages = []
    for kind in ("csv", "pq"):  # the charts read again the rows counted without being read
        page = tmp_path / f"{kind}.html"
        result = CliRunner().invoke(
            main, ["diff", str(outputs[f"a_{kind}"]), str(outputs[f"b_{kind}"]), "--html", str(page)]
        )
        assert result.exit_code == 1, result.output
        pages.append(page.read_text().replace(f"_{kind}", "_side"))
    assert pages[0] == pages[1] and "fc2.output" in pages[0]
    for name, storage in (("a_pq", ["parquet"]), ("a", ["parquet"]), ("a_csv", ["csv"])):
        assert open_input(str(outputs[name]), None).facts.storage == storage, name  # both formats: counted once


def test_parquet_rows_of_a_rank_are_its_csv_rows_and_paired_reads_only_the_rows_that_differ(outputs):
    def files(out: Path, rank: int) -> list[str]:
        return sorted(map(str, out.glob(f"parquet/run={RUN}/rank_block=0/part-{rank:05d}-*.parquet")))

    from_csv = []
    for path in sorted(next(outputs["a"].glob("*-rank1-*")).glob("*.csv")):
        category = csv_rows.CSV_FILE.match(path.name)["category"]  # type: ignore[index]
        from_csv += csv_rows.parse(path.read_bytes(), str(path), 1, category)
    a_files, b_files = files(outputs["a_pq"], 1), files(outputs["b_pq"], 1)
    assert len(a_files) == 2  # four steps, a file per two
    read = parquet_rows.rows(a_files, 1, order=("norm", "min", "max", "mean"))
    assert sorted((r.key(), r.ops, r.values) for r in read) == sorted((r.key(), r.ops, r.values) for r in from_csv)
    actv = parquet_rows.rows(a_files, 1, ["actv"])
    assert actv and {r.category for r in actv} == {"actv"} and actv[0].ops == ("max", "mean", "min", "norm")
    places = {(r.name, r.position) for r in read if r.category == "actv"}  # the CSV's row order in a step
    assert places == {(r.name, r.position) for r in from_csv if r.category == "actv" and r.micro_step == 0}
    rows_a, rows_b, counted = parquet_rows.paired(a_files, b_files, 1)
    # fc2.output at steps 1-3, 2 micro-steps each; every other row counted in the join, never read
    assert sorted(r.key() for r in rows_a) == sorted(r.key() for r in rows_b)
    assert {(r.name, r.step, r.micro_step) for r in rows_a} == {("fc2.output", s, m) for s in (1, 2, 3) for m in (0, 1)}
    assert counted.rows + len(rows_a) == len(from_csv) and counted.values == counted.rows * 4
    assert counted.steps == {0, 1, 2, 3}


def test_a_damaged_parquet_file_is_named_and_left_out_and_an_unfinished_tmp_file_is_never_read(outputs, tmp_path):
    pq = parquet_only(outputs["a"], tmp_path / "damaged")
    folder = pq / "parquet" / f"run={RUN}" / "rank_block=0"
    (folder / ".part-00000-00009.parquet.tmp").write_bytes(b"PAR1 half a file")  # a rank killed mid-write
    damaged = folder / "part-00001-00001.parquet"  # rank 1's steps 2-3
    damaged.write_bytes(damaged.read_bytes()[:-40])
    result = CliRunner().invoke(main, ["diff", str(outputs["a_csv"]), str(pq)])
    assert result.exit_code == 0, result.output  # what is left agrees
    said = [line for line in result.output.splitlines() if "Parquet" in line]
    assert any(str(damaged) in line and "cannot be read as Parquet" in line and "left out" in line for line in said)
    assert any("1 Parquet file(s) not closed yet" in line for line in said)
    assert "52 rows only on one side" in result.output  # rank 1's steps 2 and 3: 26 rows a step
    database = tmp_path / "damaged.duckdb"
    loaded = msmon("db", "-d", pq, "-o", database, "--no-progress")
    assert f"{damaged}: cannot be read as Parquet" in loaded and "left out" in loaded  # as msmon db says it


def test_a_catalog_msmon_db_built_over_parquet_files_reads_through_its_view_and_says_parquet(outputs, tmp_path):
    database = tmp_path / "b.duckdb"
    msmon("db", "-d", outputs["b_pq"], "-o", database, "--no-progress")
    assert open_input(str(database), None).facts.storage == ["parquet"]
    code, expected, _ = answer(tmp_path, outputs["a_csv"], outputs["b_csv"])
    assert answer(tmp_path, outputs["a_csv"], database)[:2] == (code, expected)
    moved = tmp_path / "moved"
    outputs["b_pq"].rename(moved)
    result = CliRunner().invoke(main, ["diff", str(outputs["a_csv"]), str(database)])
    assert result.exit_code == 2 and "no Parquet file there any more" in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_run_a_and_run_b_choose_the_run_folders_of_a_parquet_only_output(tmp_path):
    out = tmp_path / "out"
    write_output(out, run_id=RUN, time="Dec06_10-00-00")
    write_output(
        out, run_id="20261206-110000-bbbbbb", time="Dec06_11-00-00", value=changed("grad_reduced", "fc1.weight", 1)
    )
    msmon("export", "-d", out, "--to", "parquet", "--run", "all")
    for path in out.rglob("*.csv"):
        path.unlink()
    assert sorted(p.name for p in (out / "parquet").iterdir()) == [f"run={RUN}", "run=20261206-110000-bbbbbb"]
    result = CliRunner().invoke(main, ["diff", str(out), str(out), "--run-a", "20261206-10", "--run-b", "20261206-11"])
    assert result.exit_code == 1, result.output
    assert "parted at step 1: reduced gradient of fc1.weight" in result.output
    assert CliRunner().invoke(main, ["diff", str(out), str(out), "--run-a", "20261206-11"]).exit_code == 0
    for rank_dir in out.glob("Dec06_*"):  # the Parquet files alone, without their rank directories
        shutil.rmtree(rank_dir)
    alone = CliRunner().invoke(main, ["diff", str(out), str(out), "--run-a", "20261206-10"])
    assert alone.exit_code == 1 and "reduced gradient of fc1.weight" in alone.output, alone.output
    assert "run 20261206-110000-bbbbbb" in alone.output  # B: the newest, told from its folder's name


def test_calibrate_over_parquet_only_reruns_learns_what_it_learns_over_their_csv(tmp_path):
    reruns = [
        both_formats(tmp_path / f"r{i}", value=changed("exp_avg", "fc1.weight", 0, factor=1 + i * 1e-4))
        for i in range(3)
    ]
    learnt = []
    for kind, copy in (("csv", csv_only), ("pq", parquet_only)):
        paths = [copy(r, tmp_path / f"{kind}{i}") for i, r in enumerate(reruns)]
        golden = tmp_path / f"{kind}.json"
        msmon("diff", "--calibrate", *paths, "-o", golden)
        learnt.append(json.loads(golden.read_text())["observed"])
    assert learnt[0] == learnt[1]
    assert learnt[1]["exp_avg"]["norm"] == pytest.approx(2e-4, rel=0.01)


def test_nan_on_both_sides_is_the_same_value_in_the_join_and_nan_against_a_number_parts(tmp_path):
    def nan_from_step_2(category: str, name: str, step: int, rank: int, micro: int) -> float:
        return (
            float("nan")
            if (category, name) == ("grad_reduced", "fc2.weight") and step >= 2
            else base_value(category, name, step, rank, micro)
        )

    a = parquet_only(both_formats(tmp_path / "a", value=nan_from_step_2), tmp_path / "a_pq")
    b = parquet_only(both_formats(tmp_path / "b", value=nan_from_step_2), tmp_path / "b_pq")
    files = [sorted(map(str, side.glob("parquet/*/*/part-00000-*.parquet"))) for side in (a, b)]
    rows_a, rows_b, counted = parquet_rows.paired(*files, 0)
    assert (rows_a, rows_b) == ([], []) and counted.rows == 3 * 18  # NaN rows included, none read
    c = parquet_only(both_formats(tmp_path / "c"), tmp_path / "c_pq")
    code, data, _ = answer(tmp_path, a, c)
    assert code == 1 and (data["first_divergence"]["category"], data["first_divergence"]["step"]) == ("grad_reduced", 2)

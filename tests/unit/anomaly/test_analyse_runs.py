"""`msmon analyse` and its runs, first use: it says which run it read, a `--run` that names no run is
an error listing the runs even where the dump holds no record, records of several runs in one
file are told apart without a warning, and a damaged run.json in the newest run neither hides
that run's NaN nor passes in silence (records/runs.py, offline/analyse/run_choice.py)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from msmon.launcher.cli import main
from msmon.records.runs import choice_lines, choose_run, group_runs

OLD, NEW = "20261201-100000-aaaaaa", "20261202-100000-bbbbbb"


def rank_dir(out: Path, rank: int, run_id: str, started: str) -> Path:
    path = out / f"Dec0{started[9]}_10-00-00-rank{rank}-{run_id[-6:]}{rank}"
    path.mkdir(parents=True)
    (path / "run.json").write_text(json.dumps({"rank": rank, "runs": [{"run_id": run_id, "started": started}]}))
    return path


def two_runs(out: Path) -> dict[str, list[Path]]:
    return {
        OLD: [rank_dir(out, r, OLD, "2026-12-01T10:00:00") for r in (0, 1)],
        NEW: [rank_dir(out, r, NEW, "2026-12-02T10:00:00") for r in (0, 1)],
    }


def record(rank: int, step: int, run_id: str, name: str = "fc1.output", op: str = "nans") -> str:
    return json.dumps(
        {
            "rank": rank,
            "step": step,
            "micro_step": 0,
            "stage": "forward",
            "call_id": 1,
            "name": name,
            "category": "actv",
            "op": op,
            "value": 3.0,
            "rule": "AnomalyNan",
            "tag": f"0:{name}:0/rank{rank}/actv",
            "message": "3 NaN values",
            "run_id": run_id,
        }
    )


def dump(out: Path, lines_by_rank: dict[int, list[str]]) -> Path:
    for rank in (0, 1):
        folder = out / "anomaly_detected" / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        if lines_by_rank.get(rank):
            (folder / "anomaly.jsonl").write_text("\n".join(lines_by_rank[rank]) + "\n")
    return out / "anomaly_detected"


def analyse(directory: Path, *args: str):
    return CliRunner().invoke(main, ["analyse", "-d", str(directory), *args])


def test_a_run_that_names_no_run_exits_2_and_lists_the_runs_even_when_the_dump_holds_no_record(tmp_path):
    out = tmp_path / "out"
    two_runs(out)
    directory = dump(out, {})  # the dump's folders, no record: a clean run
    result = analyse(directory, "--run", "20260101")
    assert result.exit_code == 2, result.output
    assert "--run 20260101: no run with that id; the runs here are:" in result.output
    assert f"  {NEW}  started 2026-12-02 10:00:00, 2 ranks" in result.output
    assert f"  {OLD}  started 2026-12-01 10:00:00, 2 ranks" in result.output
    clean = analyse(directory)  # no --run: the newest, named, and no anomaly in it
    assert clean.exit_code == 0, clean.output
    assert f"msmon analyse: run {NEW}  started" in clean.output and f"holds no record of run {NEW}." in clean.output


def test_records_of_several_runs_in_one_file_are_read_one_run_at_a_time_without_a_warning(tmp_path):
    out = tmp_path / "out"
    two_runs(out)
    # the old run wrote steps 2 and 5, then the new run appended steps 1 and 3 to the same files
    directory = dump(out, {0: [record(0, 2, OLD), record(0, 5, OLD), record(0, 1, NEW), record(0, 3, NEW)]})
    result = analyse(directory)
    assert result.exit_code == 0, result.output
    assert "goes back" not in result.output and "analysed together" not in result.output
    assert f"msmon analyse: run {NEW}" in result.output
    report = json.loads((directory / "msmon_analyse.json").read_text())
    assert report["total"] == 2 and report["first_anomaly"]["step"] == 1 and report["skipped"] == []


def test_the_steps_of_one_run_going_back_are_still_flagged(tmp_path):
    out = tmp_path / "out"
    two_runs(out)
    directory = dump(out, {0: [record(0, 5, NEW), record(0, 1, NEW)]})
    result = analyse(directory)
    assert result.exit_code == 0
    assert f"the step goes back from 5 to 1: run {NEW} started again from an earlier step" in result.output


def test_a_damaged_run_json_in_the_newest_run_neither_hides_its_nan_nor_passes_in_silence(tmp_path):
    out = tmp_path / "out"
    dirs = two_runs(out)
    for directory in dirs[NEW]:
        (directory / "run.json").write_text('{"rank": 0, "runs": [{"run_id": "2026')  # torn
    directory = dump(out, {1: [record(1, 7, NEW, "fc2.output")]})  # the new run's NaN; the old one was clean
    result = analyse(directory)
    assert result.exit_code == 0, result.output
    assert "No anomaly" not in result.output
    report = json.loads((directory / "msmon_analyse.json").read_text())
    assert report["total"] == 1 and report["first_anomaly"]["name"] == "fc2.output"
    assert f"msmon analyse: run {NEW}, named by the anomaly dump's records; no rank directory's run.json" in (
        result.output
    )
    for damaged in dirs[NEW]:
        assert f"  {damaged}: run.json not valid JSON" in result.output
    assert f"  {OLD}  started" in result.output  # the other run, listed
    old = analyse(directory, "--run", OLD)  # the old run is still there to read, and clean
    assert old.exit_code == 0 and f"holds no record of run {OLD}." in old.output


def test_readers_of_the_rank_directories_name_a_damaged_run_json_newer_than_the_run_they_read(tmp_path):
    out = tmp_path / "out"
    dirs = two_runs(out)
    (dirs[NEW][1] / "run.json").write_text("[]")
    runs = group_runs({str(d): r for run in dirs.values() for r, d in enumerate(run)})
    chosen, others = choose_run(runs, None)
    assert chosen is not None and chosen.run_id == NEW and chosen.ranks == {0}  # rank 1 lost its run
    lines = choice_lines(chosen, others, "db")
    assert lines[0].startswith(f"msmon db: run {NEW}  started")
    assert f'  {dirs[NEW][1]}: run.json no list of "runs"' in lines
    assert any(line.startswith("msmon db: 1 rank directory with a damaged run.json, so of no run") for line in lines)

"""Under `msmon run` (real torchrun, 2 gloo ranks), three jobs into one output directory:

1. `alert.on_nan: "stop"` with an inf injected on rank 1 at step 3 (tests/scripts/nan_stop_train.py):
   both ranks stop after step 3, the job ends with msmon's exit code 3 and one line saying so (no
   torchrun report), the output, the dump and summary.json (last step 3) are complete;
2. the same script with the default `"continue"`: it trains on, and each repeated alert is logged
   once, then counted in one line per rule and tensor at the end;
3. `msmon struct`: it leaves its module trees and no rank directory.

Then `msmon db`, `report` and `convert` read the newest run (2 ranks) and list the other, and
`--run` picks the other one.
"""

from __future__ import annotations

import csv
import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e

SCRIPT = str(ROOT / "tests" / "scripts" / "nan_stop_train.py")
MSMON = [sys.executable, "-m", "msmon.launcher"]
INJECT_STEP = 3  # the script's
CONFIG = {
    "wg_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "format": ["csv"],
    "ops": ["norm", "nans", "infs"],
    "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
}


def clean_env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def msmon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MSMON, *args], capture_output=True, text=True, timeout=300, env=clean_env())


def job(tmp_path: Path, out: Path, on_nan: str, steps: int) -> subprocess.CompletedProcess:
    config = tmp_path / f"{on_nan}.json"
    config.write_text(json.dumps({**CONFIG, "alert": {**CONFIG["alert"], "on_nan": on_nan}}))
    return msmon(
        "run", "--config", str(config), "--output-dir", str(out), "--standalone", "--nproc-per-node", "2", "--",
        SCRIPT, str(steps),
    )  # fmt: skip


def run_of(rank_dir: Path) -> str:
    (run,) = json.loads((rank_dir / "run.json").read_text())["runs"]
    return run["run_id"]


def rank_dirs(out: Path) -> list[Path]:
    """The rank directories, rank 0's first."""
    return sorted(
        (Path(p) for p in glob.glob(str(out / "*-rank*-*"))), key=lambda p: (p.name.split("-rank")[1], p.name)
    )


def dump_records(out: Path, rank: int) -> list[dict]:
    lines = (out / "anomaly_detected" / f"rank{rank}" / "anomaly.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def dump_records_of(out: Path, rank: int, run_id: str) -> list[dict]:
    return [r for r in dump_records(out, rank) if r["run_id"] == run_id]


def test_three_jobs_in_one_directory_stop_on_nan_quiet_alerts_struct_and_runs_read_apart(tmp_path):
    out = tmp_path / "out"

    # 1. on_nan "stop": both ranks stop after the injection step, the job fails
    stop = job(tmp_path, out, "stop", steps=8)
    # a decision, not a crash: msmon's exit code (system/exit_codes.py), not torchrun's 1, and one line
    assert stop.returncode == 3, stop.stderr[-3000:]
    for rank in (0, 1):
        finished = [int(s) for s in re.findall(rf"rank {rank} finished step (\d+)", stop.stdout)]
        assert finished == list(range(INJECT_STEP)), stop.stdout  # step 3's optimizer.step() never returned
    decided = (
        f"msmon: the job stopped after step {INJECT_STEP} as alert.on_nan asks: non-finite statistics on ranks 0, 1 "
        "(exit code 3); the output and the anomaly dump are complete"
    )
    assert stop.stderr.splitlines().count(decided) == 1, stop.stderr[-3000:]
    assert "non-finite statistics" not in stop.stdout  # said once, by the launcher, not by each rank
    for torchrun_noise in ("ChildFailedError", "Traceback", "exitcode", "SIGTERM", "failed (exitcode"):
        assert torchrun_noise not in stop.stderr, stop.stderr[-3000:]
    first_dirs = rank_dirs(out)
    assert len(first_dirs) == 2
    first_run = run_of(first_dirs[0])
    assert run_of(first_dirs[1]) == first_run
    for rank, rank_dir in enumerate(first_dirs):
        summary = json.loads((rank_dir / "summary.json").read_text())  # closed before the exit
        assert summary["steps_recorded"] == INJECT_STEP + 1
        # step 3 was trained and recorded: a resume starts at step 4, never numbers step 3 twice
        assert (summary["last_step"], summary["next_step"]) == (INJECT_STEP, INJECT_STEP + 1)
        records = dump_records(out, rank)
        assert records and {r["step"] for r in records} == {INJECT_STEP}
        assert {r["run_id"] for r in records} == {first_run}
    # rank 1's CSV of step 3 holds the script's one inf, written before the stop
    with open(first_dirs[1] / f"actv_{INJECT_STEP}-{INJECT_STEP}.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["infs"]) for r in rows if r["name"] == "blocks.1.fc2.output"] == [1.0]
    origin_line = "msmon: first non-finite value: rank 1 step 3 micro-step 0, forward blocks.1.fc2.output"
    assert origin_line in stop.stderr.splitlines()

    # 2. on_nan "continue": trains on; one line per rule and tensor, the repeats counted at the end
    steps = 7
    cont = job(tmp_path, out, "continue", steps=steps)
    assert cont.returncode == 0, cont.stderr[-3000:]
    assert f"rank 1 finished step {steps - 1}" in cont.stdout
    step_lines = re.findall(
        r"^msmon alert \[rank (\d)\] step \d+ micro-step \S+ (\S+) \S+ history=\S+ \((\w+)\): ", cont.stderr, re.M
    )
    seen = [(rank, tag, rule) for rank, tag, rule in step_lines]
    assert len(seen) > 10
    assert len(seen) == len(set(seen)), "a rule and tensor logged twice"
    ends = re.findall(
        r"^msmon alert \[rank (\d)\] AnomalyNan on (\S+): alerted in (\d+) steps, (\d+) to (\d+) ", cont.stderr, re.M
    )
    ended = {(rank, tag): (int(n), int(a), int(b)) for rank, tag, n, a, b in ends}
    # the inf, then the NaN it makes of the weights, stays in blocks.1.fc2's output from step 3 to the end
    assert ended[("1", "0:blocks.1.fc2.output:0/rank1/actv")] == (steps - INJECT_STEP, INJECT_STEP, steps - 1)
    second_run = next(run_of(d) for d in rank_dirs(out) if d not in first_dirs)
    for (rank, tag), (count, _a, _b) in ended.items():  # every repeat is in the dump
        dumped = {r["step"] for r in dump_records(out, int(rank)) if r["tag"] == tag and r["run_id"] == second_run}
        assert len(dumped) == count

    # 3. msmon struct: module trees, and no rank directory for a later reader to take for a run
    before = rank_dirs(out)
    struct = msmon("struct", "--output-dir", str(out), "--standalone", "--nproc-per-node", "2", "--", SCRIPT, "2")
    assert struct.returncode == 0, struct.stderr[-3000:]
    assert rank_dirs(out) == before and len(before) == 4
    assert sorted(p.name for p in (out / "module_struct").iterdir()) == ["rank0", "rank1"]

    # db, report and convert: the newest run, its 2 ranks, the other one listed; --run picks it
    import duckdb

    database = tmp_path / "newest.duckdb"
    loaded = msmon("db", "-d", str(out), "-o", str(database))
    assert loaded.returncode == 0, loaded.stderr
    assert f"msmon db: run {second_run}  started " in loaded.stderr and ", 2 ranks" in loaded.stderr
    assert re.search(rf"msmon db: 1 other run\(s\) here .*\n  {first_run}  started ", loaded.stderr)
    con = duckdb.connect(str(database), read_only=True)
    assert con.execute("SELECT count(DISTINCT rank_dir) FROM files WHERE kind = 'summary'").fetchone() == (2,)
    anomalies = con.execute("SELECT count(*) FROM anomalies").fetchone()[0]
    con.close()
    assert anomalies == sum(1 for rank in (0, 1) for r in dump_records(out, rank) if r["run_id"] == second_run)

    other = tmp_path / "first.duckdb"
    assert msmon("db", "-d", str(out), "-o", str(other), "--run", first_run[:15]).returncode == 0
    con = duckdb.connect(str(other), read_only=True)
    dirs = {Path(d).name for (d,) in con.execute("SELECT DISTINCT rank_dir FROM files WHERE kind = 'csv'").fetchall()}
    assert dirs == {d.name for d in first_dirs}
    assert con.execute("SELECT DISTINCT step FROM anomalies").fetchall() == [(INJECT_STEP,)]
    con.close()
    mixed = msmon("db", "-d", str(out), "-o", str(other))  # one database holds one run
    assert mixed.returncode != 0 and f"holds run {first_run}" in mixed.stderr

    # msmon analyse reads the newest run's records of the shared dump, --run another's
    analysed = msmon("analyse", "-d", str(out / "anomaly_detected"))
    assert analysed.returncode == 0 and f"msmon analyse: run {second_run}  started " in analysed.stderr
    result = json.loads((out / "anomaly_detected" / "msmon_analyse.json").read_text())
    assert result["total"] == anomalies
    analysed = msmon("analyse", "-d", str(out / "anomaly_detected"), "--run", first_run)
    assert analysed.returncode == 0 and "1 other run(s) here" in analysed.stderr
    result = json.loads((out / "anomaly_detected" / "msmon_analyse.json").read_text())
    assert result["total"] == sum(len(dump_records_of(out, rank, first_run)) for rank in (0, 1))
    assert (result["nan_origin"]["rank"], result["nan_origin"]["name"]) == (1, "blocks.1.fc2.output")

    report = msmon("report", "-d", str(out), "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0 and f"run {second_run}" in report.stderr
    converted = msmon("convert", "csv2tb", "-d", str(out), "-o", str(tmp_path / "tb"))
    assert converted.returncode == 0, converted.stderr
    assert "of 2 rank directories" in converted.stdout and f"msmon convert: run {second_run}" in converted.stderr

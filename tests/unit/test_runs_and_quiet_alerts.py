"""Runs kept apart (records/runs.py), repeated alerts logged once per rule and tensor, `msmon
analyse` on a run without anomalies, `alert.on_nan` in the config, and the end-of-job lines."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from conftest import MLP
from msmon import TrainerMon
from msmon.config import ConfigError, parse_config
from msmon.launcher.cli import main
from msmon.launcher.run_summary import summary_lines
from msmon.records.runs import ALL_RUNS, NO_RUN, RunChoiceError, choose_run, group_runs, of_run, write_run_file


def _rank_dir(root, name: str, rank: int, run_id: str | None) -> str:
    path = root / f"Dec06_03-00-0{rank}-rank{rank}-{name}"
    path.mkdir(parents=True)
    if run_id is not None:
        write_run_file(str(path), run_id, rank)
    return str(path)


def test_rank_directories_group_into_runs_and_the_newest_is_chosen_unless_one_is_named(tmp_path):
    old = [_rank_dir(tmp_path, f"a{r}", r, "20261201-100000-aaaaaa") for r in (0, 1)]
    time.sleep(1.1)  # run.json's start time has a resolution of a second
    new = [_rank_dir(tmp_path, f"b{r}", r, "20261202-100000-bbbbbb") for r in (0, 1)]
    legacy = _rank_dir(tmp_path, "c0", 0, None)
    runs = group_runs({d: i % 2 for i, d in enumerate(old + new)} | {legacy: 0})
    by_id = {r.run_id: r for r in runs}
    assert set(by_id) == {"20261201-100000-aaaaaa", "20261202-100000-bbbbbb", NO_RUN}
    assert sorted(by_id["20261201-100000-aaaaaa"].dirs) == sorted(old) and by_id[NO_RUN].dirs == [legacy]
    assert by_id["20261202-100000-bbbbbb"].ranks == {0, 1}

    chosen, others = choose_run(runs, None)  # the newest with an id, though the unlabelled one is newer
    assert chosen is not None and chosen.run_id == "20261202-100000-bbbbbb" and len(others) == 2
    assert choose_run(runs, NO_RUN)[0] == by_id[NO_RUN]
    assert choose_run([by_id[NO_RUN]], None)[0] == by_id[NO_RUN]  # the only run
    chosen, others = choose_run(runs, "20261201")  # a unique start of an id
    assert chosen is not None and chosen.dirs == by_id["20261201-100000-aaaaaa"].dirs
    assert choose_run(runs, ALL_RUNS) == (None, [])
    with pytest.raises(RunChoiceError, match="2 runs with that id"):
        choose_run(runs, "2026120")
    with pytest.raises(RunChoiceError, match="no run with that id"):
        choose_run(runs, "zzz")

    # an anomaly record belongs to the chosen run by its run_id; one without belongs to the unlabelled
    assert of_run("20261201-100000-aaaaaa", by_id["20261201-100000-aaaaaa"])
    assert not of_run("20261202-100000-bbbbbb", by_id["20261201-100000-aaaaaa"])
    assert of_run(None, by_id[NO_RUN]) and not of_run(None, by_id["20261201-100000-aaaaaa"]) and of_run("x", None)


def test_a_directory_continued_by_a_later_run_belongs_to_both(tmp_path):
    directory = _rank_dir(tmp_path, "a", 0, "20261201-100000-aaaaaa")
    write_run_file(directory, "20261203-100000-cccccc", 0)
    write_run_file(directory, "20261203-100000-cccccc", 0)  # written once per run
    data = json.loads((tmp_path / os.path.basename(directory) / "run.json").read_text())
    assert [r["run_id"] for r in data["runs"]] == ["20261201-100000-aaaaaa", "20261203-100000-cccccc"]
    assert {r.run_id for r in group_runs({directory: 0})} == {"20261201-100000-aaaaaa", "20261203-100000-cccccc"}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_alert_repeated_at_every_step_is_logged_once_then_counted_in_one_line(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = {
        "xy_distribution": True,
        "targets": {"fc1": {"input": "tensor"}},
        "format": "csv",
        "ops": ["norm", "nans"],
        "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
        "nan_origin": False,
    }
    mon = TrainerMon(write_config(config))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    handler = _Lines()
    logging.getLogger("msmon").addHandler(handler)
    steps = 5
    try:
        for _ in range(steps):
            model(torch.full((2, 8), math.nan)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        mon.close()
    finally:
        logging.getLogger("msmon").removeHandler(handler)
    alert_lines = [line for line in handler.lines if line.startswith("msmon alert")]
    step_lines = [line for line in alert_lines if " micro-step " in line]
    tags = [line.split()[8] for line in step_lines]  # each (rule, tensor) once, at the step it first alerted
    assert (
        sorted(tags)
        == sorted(set(tags))
        == ["0:fc1.input:0/rank0/actv", "0:fc1.output:0/rank0/actv", "0:fc1.output:0/rank0/actv_grad"]
    )
    assert step_lines[0] == (
        "msmon alert [rank 0] step 0 micro-step 0 0:fc1.input:0/rank0/actv nans=16 history=none (AnomalyNan): "
        "16 NaN values"
    )
    assert not [line for line in step_lines if " step 2 " in line or " step 4 " in line]  # repeats only: silent
    assert alert_lines[len(step_lines) :] == [  # and at the end one line per rule and tensor, with the count
        "msmon alert [rank 0] AnomalyNan on 0:fc1.input:0/rank0/actv: alerted in 5 steps, 0 to 4 "
        "(the first one logged; all in the anomaly dump)",
        "msmon alert [rank 0] AnomalyNan on 0:fc1.output:0/rank0/actv: alerted in 5 steps, 0 to 4 "
        "(the first one logged; all in the anomaly dump)",
        "msmon alert [rank 0] AnomalyNan on 0:fc1.output:0/rank0/actv_grad: alerted in 4 steps, 1 to 4 "
        "(the first one logged; all in the anomaly dump)",
    ]
    dump = output_dir / "anomaly_detected" / "rank0" / "anomaly.jsonl"
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [r["step"] for r in records if r["name"] == "fc1.input"] == list(range(steps))  # every alert kept


def test_on_nan_takes_continue_or_stop_and_nothing_else():
    assert parse_config({}).alert.on_nan == "continue"
    assert parse_config({"alert": {"on_nan": "stop"}}).alert.on_nan == "stop"
    with pytest.raises(ConfigError, match=r"alert.on_nan: expected one of \['continue', 'stop'\], got 'halt'"):
        parse_config({"alert": {"on_nan": "halt"}})


def test_analyse_says_no_anomaly_and_exits_0_on_an_empty_dump_but_1_without_a_dump(tmp_path):
    dump = tmp_path / "out" / "anomaly_detected"
    for rank in (0, 1):
        (dump / f"rank{rank}").mkdir(parents=True)  # what the dump makes as the monitor starts
    result = CliRunner().invoke(main, ["analyse", "-d", str(dump)])
    assert result.exit_code == 0, result.output
    assert "No anomaly: the anomaly dump of 2 rank(s)" in result.output
    report = json.loads((dump / "msmon_analyse.json").read_text())
    assert report["total"] == 0 and report["first_anomaly"] is None
    # the output directory itself works too; a folder with no dump at all is still an error
    assert CliRunner().invoke(main, ["analyse", "-d", str(tmp_path / "out")]).exit_code == 0
    (tmp_path / "empty").mkdir()
    assert CliRunner().invoke(main, ["analyse", "-d", str(tmp_path / "empty")]).exit_code == 1


def test_the_end_of_job_lines_name_the_first_non_finite_value_in_training_order_and_the_next_commands(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))  # msmon found
    out = tmp_path / "out"
    (out / "anomaly_detected").mkdir(parents=True)
    origins = {  # rank 0 meets it in the optimizer, after rank 1's forward made it, in the same step
        0: {"step": 3, "rank": 0, "stage": "optimizer", "micro_step": None, "tensor": "fc1.weight"},
        1: {"step": 3, "rank": 1, "stage": "forward", "micro_step": 0, "tensor": "fc2.output"},
    }
    records = []
    for rank, origin in origins.items():
        log_dir = out / f"Dec06_03-00-00-rank{rank}-x"
        log_dir.mkdir()
        (log_dir / "summary.json").write_text(json.dumps({"steps_recorded": 4, "alerts": 2, "first_nonfinite": origin}))
        records.append({"rank": rank, "monitors": [{"rank": rank, "log_dir": str(log_dir), "output_base": str(out)}]})
    lines = summary_lines(records, "run", str(out), "20261206-031500-abcdef")
    assert lines[2] == "msmon: first non-finite value: rank 1 step 3 micro-step 0, forward fc2.output"
    assert lines[3] == (
        f"msmon: run 20261206-031500-abcdef; next: msmon analyse -d {out / 'anomaly_detected'} (the first anomaly "
        f"across ranks), msmon report -d {out} --run 20261206-031500-abcdef -o report.html (one HTML page)"
    )
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a fresh shell without the venv: this msmon by its path
    shown = summary_lines(records, "run", str(out), "r")[-1].split("; next: ")[1].split(" analyse -d ")[0]
    assert os.sep in shown and os.path.samefile(shown, os.path.join(os.path.dirname(sys.executable), "msmon"))


def test_analyse_reads_the_newest_run_of_a_dump_copied_without_its_rank_directories(tmp_path):
    dump = tmp_path / "anomaly_detected" / "rank0"
    dump.mkdir(parents=True)
    record = {"rank": 0, "stage": "forward", "name": "fc1.output", "category": "actv", "rule": "AnomalyNan"}
    runs = {"20261201-100000-aaaaaa": [2, 5], "20261202-100000-bbbbbb": [7]}
    lines = [json.dumps({**record, "step": step, "run_id": run}) for run, steps in runs.items() for step in steps]
    (dump / "anomaly.jsonl").write_text("\n".join(lines) + "\n")
    directory = str(tmp_path / "anomaly_detected")

    def analysed(*args: str) -> dict:
        result = CliRunner().invoke(main, ["analyse", "-d", directory, *args])
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / "anomaly_detected" / "msmon_analyse.json").read_text())

    assert analysed()["first_anomaly"]["step"] == 7  # the newest id: ids sort by start time
    assert analysed("--run", "20261201")["total"] == 2
    assert analysed("--run", "all")["total"] == 3
    assert CliRunner().invoke(main, ["analyse", "-d", directory, "--run", "2026120"]).exit_code == 2


def test_on_nan_stop_in_one_process_ends_it_after_the_step_with_its_output_written(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {"wg_distribution": True, "format": "csv", "ops": ["norm", "nans"]}
    config["alert"] = {"rules": [{"rule_name": "AnomalyNan"}], "dump": True, "on_nan": "stop"}
    mon = TrainerMon(write_config(config))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    finished = []
    with pytest.raises(SystemExit) as stopped:
        for step in range(6):
            x = torch.full((2, 8), math.nan) if step == 2 else torch.randn(2, 8)
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            finished.append(step)
    assert stopped.value.code == 3 and finished == [0, 1]  # step 2's optimizer.step() did not return
    (rank_dir,) = output_dir.glob("*-rank0-*")
    summary = json.loads((rank_dir / "summary.json").read_text())  # the monitor closed first
    assert summary["steps_recorded"] == 3
    assert (summary["last_step"], summary["next_step"]) == (2, 3)  # step 2 was trained and recorded
    records = [json.loads(line) for line in (output_dir / "anomaly_detected" / "rank0" / "anomaly.jsonl").open()]
    assert {r["step"] for r in records} == {2}  # the step's alerts written before the exit

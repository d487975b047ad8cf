"""The monitor tells its own cost at the end of a run: in summary.json, on stderr for an API
user, and in the launcher's end-of-job line."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import MLP, rank_dir
from msmon import TrainerMon
from msmon.launcher import run_summary
from msmon.runtime.cost import CostMeter, describe


def test_cost_is_relative_to_the_steps_after_the_first():
    meter = CostMeter()
    meter.attached()
    meter.seconds = 0.5  # the first step's one-off work
    meter.step_ended(10.0)
    meter.seconds += 0.02
    meter.step_ended(11.0)
    meter.seconds += 0.04
    meter.step_ended(12.0)
    got = meter.report(writer_cpu_seconds=0.3)
    assert got["steps_timed"] == 2 and got["step_ms"] == pytest.approx(1000.0)
    assert got["monitor_ms_per_step"] == pytest.approx(30.0)
    assert got["monitor_cost_pct"] == pytest.approx(3.0)
    assert got["monitor_seconds"] == pytest.approx(0.56)
    assert got["writer_cpu_ms_per_step"] == pytest.approx(100.0)  # over every step: the writer works on all
    assert describe(got) == (
        "monitor cost 3.0 % of step time (30.0 ms of 1000.0 ms per step on the training "
        "thread; writer thread 100.0 ms CPU per step)"
    )


def test_a_run_without_a_full_step_says_the_cost_was_not_measured():
    meter = CostMeter()
    assert meter.report()["monitor_cost_pct"] is None
    assert describe(meter.report()) == "monitor cost not measured (fewer than one full step)"


def test_close_writes_the_cost_to_the_summary_and_logs_it(write_config, output_dir, caplog):
    caplog.set_level(logging.INFO, logger="msmon")
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon(
        write_config({"wg_distribution": True, "xy_distribution": True, "format": "csv"}), params_have_main_grad=False
    )
    mon.set_monitor(model, optimizer)
    for _ in range(6):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    summary = json.loads((rank_dir(output_dir) / "summary.json").read_text())
    assert summary["steps_recorded"] == 6 and summary["steps_timed"] == 5
    assert 0 < summary["monitor_ms_per_step"] < summary["step_ms"]
    assert 0 < summary["monitor_cost_pct"] < 100
    assert summary["writer_cpu_seconds"] > 0  # six steps of rows were written off the training thread
    (line,) = [r.getMessage() for r in caplog.records if "monitor cost" in r.getMessage()]
    assert line.startswith("msmon[rank 0]: 6 steps recorded; monitor cost ") and "% of step time" in line


API_SCRIPT = """
import torch
from msmon import TrainerMon
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
mon = TrainerMon(CONFIG, params_have_main_grad=False)
mon.set_monitor(model, optimizer)
for _ in range(3):
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_script_without_logging_set_up_sees_the_cost_on_stderr_at_exit(write_config, tmp_path):
    config = write_config({"wg_distribution": True, "format": "csv"})
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(tmp_path / "out"))
    env.pop("MSMON_BOOTSTRAP_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", f"CONFIG = {str(config)!r}\n" + API_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^msmon\[rank 0\]: 3 steps recorded; monitor cost [\d.]+ % of step time ", proc.stderr, re.M), (
        proc.stderr
    )


def test_the_launcher_line_carries_each_rank_cost(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))  # msmon found
    log_dir = tmp_path / "out" / "Dec02-rank0-x"
    log_dir.mkdir(parents=True)
    (log_dir / "summary.json").write_text(
        json.dumps(
            {
                "steps_recorded": 7,
                "alerts": 0,
                "monitor_cost_pct": 2.5,
                "monitor_ms_per_step": 1.5,
                "step_ms": 60.0,
                "writer_cpu_ms_per_step": 0.7,
            }
        )
    )
    records = [
        {
            "rank": 0,
            "monitors": [
                {"rank": 0, "log_dir": str(log_dir), "output_base": str(tmp_path / "out"), "optimizer": "AdamW"}
            ],
        }
    ]
    line, next_steps = run_summary.summary_lines(records, "run")
    assert next_steps.startswith("msmon: run (no id); next: msmon report -d ")
    assert line.startswith(
        "msmon: rank 0: 7 steps recorded, 0 alerts raised, monitor cost 2.5 % of step time "
        "(1.5 ms of 60.0 ms per step on the training thread; writer thread 0.7 ms CPU per step) -> "
    )

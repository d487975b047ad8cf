"""A script that changes its working directory after msmon attached: every later write still
lands in the directory that was meant when monitoring started (output paths are absolute from
the start, MONITOR_OUTPUT_DIR, its default and the config file's path alike)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import MLP, ROOT, rank_dir, read_csv_rows, train_steps
from msmon import TrainerMon

CONFIG = {"wg_distribution": True, "param_distribution": True, "format": ["csv"], "ops": ["norm"]}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture
def two_dirs(tmp_path, monkeypatch):
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    return start, elsewhere


@pytest.mark.parametrize("relative", ["out", None])  # MONITOR_OUTPUT_DIR relative, or its default
def test_rows_and_summary_of_an_api_monitor_land_where_the_job_started_after_a_chdir(relative, two_dirs, monkeypatch):
    start, elsewhere = two_dirs
    if relative:
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", relative)
    else:
        monkeypatch.delenv("MONITOR_OUTPUT_DIR", raising=False)
    (start / "monitor.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon("monitor.json")
    mon.set_monitor(model, optimizer)
    train_steps(model, optimizer, 1)
    os.chdir(elsewhere)
    train_steps(model, optimizer, 2)
    mon.close()
    directory = rank_dir(start / (relative or "monitor_output"))
    assert {int(r["step"]) for r in read_csv_rows(directory, "param_origin")} == {0, 1, 2}
    assert json.loads((directory / "summary.json").read_text())["steps_recorded"] == 3
    assert not list(elsewhere.iterdir())


def test_a_relative_config_path_is_still_polled_for_edits_after_a_chdir(two_dirs, monkeypatch):
    start, elsewhere = two_dirs
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", "out")
    (start / "monitor.json").write_text(json.dumps(CONFIG))
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon("monitor.json")
    mon.set_monitor(model, optimizer)
    train_steps(model, optimizer, 1)
    os.chdir(elsewhere)
    (start / "monitor.json").write_text(json.dumps({**CONFIG, "ops": ["norm", "max"]}))
    train_steps(model, optimizer, 2)
    mon.close()
    rows = read_csv_rows(rank_dir(start / "out"), "param_origin")
    assert {int(r["step"]) for r in rows if "max" in r} == {2}


@pytest.mark.e2e
def test_an_unmodified_script_that_changes_directory_under_msmon_run_keeps_its_rows_and_summary(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "monitor.json").write_text(json.dumps(CONFIG))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "msmon.launcher",
            "run",
            "--config",
            "monitor.json",
            "--no-torchrun",
            "--",
            str(ROOT / "tests" / "scripts" / "output_chdir.py"),
            "--to",
            str(elsewhere),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    directory = rank_dir(tmp_path / "monitor_output")
    assert {int(r["step"]) for r in read_csv_rows(directory, "param_origin")} == {0, 1, 2}
    assert json.loads((directory / "summary.json").read_text())["steps_recorded"] == 3
    assert not list(elsewhere.iterdir())

"""`make demo`'s job as a new user meets it: `msmon run` with examples/monitor.json on a real 2-rank
torchrun job, from a shell where msmon is not on PATH (the venv is not activated). The commands
its `next:` line prints run as printed from a fresh shell, and the report they write shows the
loss per rank and the gradients' agreement, which the example config records."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e

FRESH_PATH = "/usr/local/bin:/usr/bin:/bin"  # a new terminal: the project's .venv/bin is not on it


def fresh_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = FRESH_PATH
    env.pop("VIRTUAL_ENV", None)
    return env


def report_data(page: Path) -> dict:
    text = page.read_text()
    block = re.search(r'<script type="application/json" id="msmon-data">(.*?)</script>', text, re.S)
    assert block is not None
    return json.loads(block[1])


def test_the_demo_records_loss_and_agreement_and_its_next_commands_work_from_a_fresh_shell(tmp_path):
    assert json.loads((ROOT / "examples" / "monitor.json").read_text())["grad_agreement"] is True
    job = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "run", "--config", str(ROOT / "examples" / "monitor.json")]
        + ["--output-dir", "monitor_output", "--standalone", "--nproc-per-node", "2", "--"]
        + [str(ROOT / "examples" / "train_tiny_gpt.py"), "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=fresh_env(),
    )
    assert job.returncode == 0, job.stderr[-3000:]
    (hint,) = [line for line in job.stderr.splitlines() if "; next: " in line]
    commands = [c.split(" (")[0] for c in hint.split("; next: ")[1].split("), ")]
    assert len(commands) == 2 and " report -d monitor_output --run " in commands[1], hint
    program = str(Path(sys.executable).parent / "msmon")
    assert all(c.startswith(program + " ") for c in commands), hint  # not a bare `msmon`: it is not on PATH
    for command in commands:  # as printed, in a fresh shell
        ran = subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=fresh_env()
        )
        assert ran.returncode == 0, (command, ran.stderr[-2000:])
    data = report_data(tmp_path / "report.html")
    assert sorted(line["rank"] for line in data["loss"]["lines"]) == [0, 1]  # the loss, per rank
    agreement = data["agreement"]  # the agreement, in a chart of its own (its signed cos is no heatmap's |value|)
    assert agreement["rows"] == [0, 1] and agreement["steps"] == 4, agreement
    assert all(isinstance(v, float) for v in agreement["cos"][0] + agreement["norm_ratio"][1]), agreement

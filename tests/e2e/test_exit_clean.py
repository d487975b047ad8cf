"""A job whose script leaves collectives in flight at exit ends cleanly under `msmon run`
(real torchrun, 2 ranks on gloo): gloo's worker threads finish and release them before the
interpreter shuts down (src/msmon/system/exit_drain.py), so no rank dies of "terminate called without
an active exception" in its teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "tests" / "scripts" / "exit_async_tail.py"
ABORT = "terminate called without an active exception"
RUNS = 4


def test_a_script_leaving_async_all_gathers_in_flight_exits_0_under_msmon_run_every_time(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"wg_distribution": True, "format": ["csv"], "ops": ["norm"]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    for run in range(RUNS):
        argv = [sys.executable, "-m", "msmon.launcher", "run", "--config", str(config)]
        argv += ["--output-dir", str(tmp_path / f"out{run}"), "--standalone", "--nproc-per-node", "2"]
        argv += ["--", str(SCRIPT)]
        job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        out, err = job.communicate(timeout=300)  # Popen: never the conftest's rerun of an aborted job
        assert ABORT not in out + err, f"run {run + 1}: {err[-3000:]}"
        assert job.returncode == 0, f"run {run + 1}: {err[-3000:]}"
        assert "rank 0 left 200 all_gathers in flight" in out and "rank 1 left 200 all_gathers in flight" in out

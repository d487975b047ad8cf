"""SIGINT sent to `msmon run`'s process alone (a scheduler signalling the launcher, `kill -INT`)
stops a real 2-rank torchrun job as it stops plain torchrun: within seconds, every step the
ranks finished before it kept in their CSV files, and each monitor closed (summary.json).
How the launcher tells this SIGINT from the terminal's Ctrl-C: tests/unit/launcher/test_signal_forwarding.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, rank_dir, read_csv_rows

pytestmark = pytest.mark.e2e

SCRIPT = str(ROOT / "tests" / "scripts" / "launcher_ddp.py")
STEPS = 1500  # far more than it runs before the signal, and a bound if the signal were lost
ENDS_WITHIN_S = 15  # plain torchrun: about 2 s; on a loaded 2-core machine, more


def test_sigint_to_the_launcher_alone_stops_the_job_within_seconds_keeping_what_was_recorded(tmp_path):
    config, out = tmp_path / "monitor.json", tmp_path / "out"
    config.write_text(json.dumps({"wg_distribution": True, "format": ["csv"], "ops": ["norm"]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "msmon.launcher", "run", "--config", str(config), "--output-dir", str(out)]
    argv += ["--standalone", "--nproc-per-node", "2", "--", SCRIPT, "--steps", str(STEPS)]
    # a session of its own: no terminal, and nothing but this test's kill reaches the launcher
    errors = open(tmp_path / "stderr.txt", "w+")  # a file: a full stderr pipe would stall the job unread
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True, env=env, start_new_session=True)
    printed: list[str] = []

    def read() -> None:  # two ranks' prints may share a line: the test looks at the text, not at lines
        assert proc.stdout is not None
        for line in proc.stdout:
            printed.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while "rank 1 step 3 " not in "".join(printed) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank 1 step 3 " in "".join(printed), "".join(printed)[-2000:]
        os.kill(proc.pid, signal.SIGINT)  # the launcher's pid only, not its process group
        sent = time.monotonic()
        proc.wait(timeout=120)
        ended_after = time.monotonic() - sent
        reader.join(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        errors.seek(0)
        err = errors.read()
        errors.close()
    assert ended_after < ENDS_WITHIN_S, (ended_after, err[-3000:])
    assert proc.returncode != 0  # torchrun's own code for a job it stopped on a signal
    for rank in (0, 1):
        done = [int(s) for s in re.findall(rf"rank {rank} step (\d+) ", "".join(printed))]
        rows = read_csv_rows(rank_dir(out, rank), "grad_reduced")
        steps = sorted({int(r["step"]) for r in rows})
        assert steps == list(range(len(steps))) and steps[-1] >= max(done, default=0), (rank, steps, done)
        summary = json.loads((rank_dir(out, rank) / "summary.json").read_text())  # the monitor closed
        assert summary["steps_recorded"] == len(steps)
    assert re.search(r"^msmon: rank 0: \d+ steps recorded", err, re.M), err[-3000:]

"""The guard that keeps a multi-process test job from hanging CI: conftest.run_job kills every
process the job started when it times out and fails the test with what the job printed, and
tests/scripts/fake_srun.py ends the other tasks as soon as one fails (as srun
--kill-on-bad-exit does), instead of leaving them waiting for it in torch.distributed."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import ROOT, run_job

# a launcher that starts a rank and waits for it; the rank prints, writes its pid, then hangs
HANGING_JOB = """
import subprocess, sys
print("launcher: started", flush=True)
rank = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
print("rank: waiting for a peer that never comes", file=sys.stderr, flush=True)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(600)
''', sys.argv[1]])
rank.wait()
"""


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead and not yet reaped by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_job_past_its_timeout_is_killed_with_every_process_it_started_and_fails_with_its_output(tmp_path):
    pid_file = tmp_path / "rank.pid"
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_job([sys.executable, "-c", HANGING_JOB, str(pid_file)], timeout=5)
    assert time.monotonic() - started < 60
    message = str(failed.value)
    assert "timed out after 5 s" in message
    assert "launcher: started" in message and "rank: waiting for a peer that never comes" in message
    rank = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(rank) and time.monotonic() < deadline:  # SIGKILL is delivered at once; allow for a loaded machine
        time.sleep(0.1)
    assert not alive(rank)


def test_a_job_that_ends_in_time_gives_its_exit_code_and_output(tmp_path):
    job = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    result = run_job([sys.executable, "-c", job], timeout=60, cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_fake_srun_ends_the_other_tasks_as_soon_as_one_fails(tmp_path):
    task = "import os, sys, time\nif os.environ['SLURM_PROCID'] == '0':\n    sys.exit(3)\ntime.sleep(600)"
    started = time.monotonic()
    result = run_job(
        [sys.executable, str(ROOT / "tests" / "scripts" / "fake_srun.py"), "2", "--", sys.executable, "-c", task],
        timeout=60,
    )
    assert result.returncode == 3
    assert time.monotonic() - started < 30  # not the 600 s task 1 would wait
    assert "fake_srun: a task exited with 3: ending task 1" in result.stderr

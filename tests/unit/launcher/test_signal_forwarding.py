"""`msmon run`'s job gets a SIGINT exactly once, whoever sent it: passed on when it was sent to the
launcher alone (kill, a scheduler), left alone when it came from the terminal (Ctrl-C reaches
every process of the foreground group, the job's too). A launcher (launch.run_child) runs in a
session of its own on a pseudo-terminal; its job counts the SIGINTs it gets. The same on a real
torchrun job: tests/e2e/test_launcher_signals.py."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

LAUNCHER = """
import sys
from msmon.launcher.launch import run_child
code = run_child([sys.executable, sys.argv[1], sys.argv[2]], dict(__import__("os").environ))
print("launcher: job exit code", code, flush=True)
"""

# counts the SIGINTs it gets; ends 0.5 s after the first (time for a second one to arrive) or after 20 s
JOB = """
import pathlib, signal, sys, time
count = []
signal.signal(signal.SIGINT, lambda *_: count.append(time.monotonic()))
pathlib.Path(sys.argv[1] + ".ready").touch()
deadline = time.monotonic() + 20
while time.monotonic() < deadline and not (count and time.monotonic() > count[0] + 0.5):
    time.sleep(0.02)
pathlib.Path(sys.argv[1]).write_text(str(len(count)))
"""


def _controlling_terminal() -> None:  # in the child, after setsid: the pty on stdin becomes its terminal
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def sigints_the_job_got(tmp_path: Path, send) -> tuple[int, str]:
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "job.py").write_text(JOB)
    counted = tmp_path / "count"
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "job.py"), str(counted)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=_controlling_terminal,
    )
    os.close(slave)
    output = b""
    try:
        deadline = time.monotonic() + 30
        while not Path(f"{counted}.ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # the launcher blocks its signals right after it started the job
        send(proc.pid, master)
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    output += os.read(master, 4096)
                except OSError:
                    break
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(master)
    return int(counted.read_text()), output.decode(errors="replace")


@pytest.mark.skipif(not hasattr(signal, "sigtimedwait"), reason="sigtimedwait: Linux")
def test_a_sigint_sent_to_the_launcher_alone_reaches_the_job_once(tmp_path):
    count, output = sigints_the_job_got(tmp_path, lambda pid, _tty: os.kill(pid, signal.SIGINT))
    assert count == 1, output
    assert "launcher: job exit code 0" in output


@pytest.mark.skipif(not hasattr(signal, "sigtimedwait"), reason="sigtimedwait: Linux")
def test_ctrl_c_in_the_terminal_reaches_the_job_once_not_twice(tmp_path):
    count, output = sigints_the_job_got(tmp_path, lambda _pid, tty: os.write(tty, b"\x03"))
    assert count == 1, output
    assert "launcher: job exit code 0" in output

"""Children a script forks with multiprocessing (start method "fork") from a process that is no
rank yet: one that trains is monitored, with its output closed although multiprocessing ends it
with os._exit; a helper that builds nothing says nothing (`import msmon.auto`, no launcher).
The parent trains last, in a function: its optimizer is dropped (and its monitor closed) before
the process ends, which must not make it say that nothing was monitored."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_a_forked_child_that_trains_is_monitored_and_a_forked_helper_says_nothing(output_dir):
    script = ROOT / "tests" / "scripts" / "auto_forked_children.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("monitoring SGD of Linear") == 2, proc.stderr  # the training child, then the parent
    assert "no optimizer was monitored" not in proc.stderr, proc.stderr
    summaries = [json.loads(path.read_text()) for path in output_dir.glob("*/summary.json")]
    assert sorted(s["steps_recorded"] for s in summaries) == [1, 1]  # the child's written at its os._exit

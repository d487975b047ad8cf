"""`make demo`'s job under `msmon run` with msmon imported from a given checkout: the command and
its environment, shared by the benchmarks that compare revisions (output_identity.py,
demo_cost.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "examples" / "monitor.json"


def demo_command(script: Path, *script_args: str) -> list[str]:
    """`msmon run --config examples/monitor.json --nproc-per-node 2 -- script ...`."""
    launcher = [sys.executable, "-m", "msmon.launcher", "run", "--config", str(DEMO_CONFIG), "--nproc-per-node", "2"]
    return [*launcher, "--", str(script), *script_args]


def demo_env(src: Path, out: Path) -> dict[str, str]:
    """msmon from `src` (a checkout's src/ folder), output under `out`, one OpenMP thread per
    rank as torchrun sets it."""
    return dict(os.environ, PYTHONPATH=str(src), MONITOR_OUTPUT_DIR=str(out), OMP_NUM_THREADS="1")

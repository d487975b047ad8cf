"""What `alert.on_nan: "stop"` costs a healthy job: the demo's job (benchmarks/timed_example.py,
DDP on gloo, 2 ranks) under `msmon run` with the example's config, once with `"continue"` and
once with `"stop"`, alternating, in fresh processes.

    python benchmarks/nan_stop_cost.py --rounds 3 --steps 40 [--json out.json]

"stop" adds, at the end of every step, a wait for the step's statistics on the host and one
one-number all_gather on msmon's gloo group (runtime/nan_stop.py). Per run: each rank's median
step (after the warm-up, timed inside the training loop) and what msmon reports about itself
(summary.json's monitor_ms_per_step). The table gives the medians over rounds and the ratio of
the "stop" step to the "continue" step of the same round.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def one_run(on_nan: str, steps: int, scratch: Path) -> dict[str, Any]:
    config = json.loads((ROOT / "examples" / "monitor.json").read_text())
    config["alert"]["on_nan"] = on_nan
    config_path = scratch / f"{on_nan}.json"
    config_path.write_text(json.dumps(config))
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "MONITOR_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "run", "--config", str(config_path), "--output-dir", str(out),
         "--standalone", "--nproc-per-node", "2", "--", str(ROOT / "benchmarks" / "timed_example.py"),
         "--steps", str(steps)],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{on_nan} run failed:\n{proc.stderr[-3000:]}")
    timed = [json.loads(m) for m in re.findall(r"^TIMED (.*)$", proc.stdout, re.M)]
    summaries = [json.loads(Path(p).read_text()) for p in glob.glob(str(out / "*-rank*-*" / "summary.json"))]
    return {
        "step_ms": statistics.median(t["step_ms"] for t in timed),
        "monitor_ms_per_step": statistics.median(s["monitor_ms_per_step"] for s in summaries),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="msmon-nan-stop-") as scratch:
        for i in range(args.rounds):
            order = ("continue", "stop") if i % 2 == 0 else ("stop", "continue")
            rounds.append({mode: one_run(mode, args.steps, Path(scratch)) for mode in order})
            print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
    for mode in ("continue", "stop"):
        step = statistics.median(r[mode]["step_ms"] for r in rounds)
        own = statistics.median(r[mode]["monitor_ms_per_step"] for r in rounds)
        print(f"{mode:8s}: step {step:.1f} ms (median of rounds), msmon's own time {own:.1f} ms per step")
    ratios = [r["stop"]["step_ms"] / r["continue"]["step_ms"] for r in rounds]
    print(f"stop / continue step, same round: median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "rounds": rounds, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()

"""What the ranks' per-step vote costs a healthy job: `alert.on_nan: "stop"` and `alert.actions`
configured but never firing. The demo's job (benchmarks/timed_example.py, DDP on gloo, 2 ranks)
under `msmon run` with the example's config, in fresh processes, the modes of a round in a
rotating order:

    continue  on_nan "continue", no action: no vote
    stop      on_nan "stop": one round per step (a wait for the step's statistics on the host,
              one two-number all_gather on msmon's gloo group: runtime/actions/vote.py)
    actions   "stop" plus escalate, notify and stop actions whose rules never fire in this job: the
              same round, with the alerts the job does raise carried to the other ranks when any
              (one more gather of bytes) and a bounded wait for this rank's readers of the step
              before (free while the writer keeps up)
    skip      "stop" plus a skip_step action that never fires: before every optimizer step, the
              rows recorded so far read on the host, the rules scanned, one more round

    python benchmarks/nan_stop_cost.py --rounds 3 --steps 40 [--modes continue stop actions] [--json out.json]

Per run: each rank's median step (after the warm-up, timed inside the training loop) and what
msmon reports about itself (summary.json's monitor_ms_per_step, and of it the vote's rounds and
the wait for this rank's readers of the voted step: summary.json's "vote"). The table gives the medians over
rounds and the ratio of each mode's step to the "stop" step of the same round: "actions" should
be within the noise of "stop" (issue 43); "skip" costs what docs/actions.md says.
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
MODES = ("continue", "stop", "actions", "skip")
NEVER = "verdict:one_rank_model_copy"  # a verdict a healthy DDP job never gets (its replicas stay alike)
ACTIONS = {
    "actions": [
        {"on": ["AnomalyNan", NEVER], "do": "escalate", "for_steps": 3, "config": {"param_distribution": True}},
        {"on": ["AnomalyNan"], "do": "notify", "url": "http://127.0.0.1:9/never"},
        {"on": [NEVER], "do": "stop"},
    ],
    "skip": [{"on": ["AnomalyNan"], "do": "skip_step"}],
}


def config_of(mode: str) -> dict[str, Any]:
    config = json.loads((ROOT / "examples" / "monitor.json").read_text())
    config["alert"]["on_nan"] = "continue" if mode == "continue" else "stop"
    if mode in ACTIONS:
        config["alert"]["actions"] = ACTIONS[mode]
    return config


def timed_lines(stdout: str) -> list[dict[str, Any]]:
    """The ranks' TIMED objects: two ranks share torchrun's stdout, and one's line may run on
    into the other's (`TIMED {...}TIMED {...}`), so each is decoded from where it starts."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(stdout, m.end())[0] for m in re.finditer(r"TIMED ", stdout)]


def one_run(mode: str, steps: int, scratch: Path) -> dict[str, Any]:
    config_path = scratch / f"{mode}.json"
    config_path.write_text(json.dumps(config_of(mode)))
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "MONITOR_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "run", "--config", str(config_path), "--output-dir", str(out),
         "--standalone", "--nproc-per-node", "2", "--", str(ROOT / "benchmarks" / "timed_example.py"),
         "--steps", str(steps)],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    timed = timed_lines(proc.stdout)
    summaries = [json.loads(Path(p).read_text()) for p in glob.glob(str(out / "*-rank*-*" / "summary.json"))]
    fired = [s for s in summaries if s.get("escalations") or s.get("skips") or s.get("actions_off")]
    if fired:
        raise SystemExit(f"{mode}: an action fired or the vote failed; this benchmark needs a job where none fires")
    votes = [s["vote"] for s in summaries if s.get("vote", {}).get("rounds")]
    return {
        "step_ms": statistics.median(t["step_ms"] for t in timed),
        "monitor_ms_per_step": statistics.median(s["monitor_ms_per_step"] for s in summaries),
        # of msmon's own time: the rounds' gathers, and the wait for this rank's readers of the voted step
        "vote_ms_per_step": statistics.median(1e3 * v["round_seconds"] / v["rounds"] for v in votes) if votes else 0.0,
        "reader_wait_ms_per_step": (
            statistics.median(1e3 * v["reader_wait_seconds"] / v["rounds"] for v in votes) if votes else 0.0
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args()
    modes = list(dict.fromkeys(["stop", *args.modes]))  # "stop" is what the others are compared with
    rounds = []
    with tempfile.TemporaryDirectory(prefix="msmon-vote-cost-") as scratch:
        for i in range(args.rounds):
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            rounds.append({mode: one_run(mode, args.steps, Path(scratch)) for mode in order})
            print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
    ratios: dict[str, list[float]] = {}
    for mode in modes:
        step = statistics.median(r[mode]["step_ms"] for r in rounds)
        own = statistics.median(r[mode]["monitor_ms_per_step"] for r in rounds)
        vote = statistics.median(r[mode]["vote_ms_per_step"] for r in rounds)
        wait = statistics.median(r[mode]["reader_wait_ms_per_step"] for r in rounds)
        ratios[mode] = [r[mode]["step_ms"] / r["stop"]["step_ms"] for r in rounds]
        print(
            f"{mode:8s}: step {step:.1f} ms, msmon's own time {own:.2f} ms per step (of it the rounds {vote:.2f} ms, "
            f"the readers' wait {wait:.2f} ms; medians of rounds); "
            f"step / stop's, same round: median {statistics.median(ratios[mode]):.3f} "
            f"(range {min(ratios[mode]):.3f}-{max(ratios[mode]):.3f})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "rounds": rounds, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()

"""How often a job ends in gloo's teardown abort, under plain torchrun and under `msmon run`.

    python benchmarks/exit_aborts.py                        # 16 runs of each launcher, HF Trainer job
    python benchmarks/exit_aborts.py --runs 8 --launchers msmon --job async_tail --json out.json

The job is an unmodified HF Trainer DDP script (tests/scripts/launcher_hf_trainer.py: tiny GPT-2,
2 ranks on gloo, 3 steps), or `async_tail` (tests/scripts/exit_async_tail.py: a script whose
last act is an all_gather it never waits for). A run "aborts" when its output holds
"terminate called without an active exception" (a rank died of SIGABRT in interpreter
teardown: a gloo worker thread released a finished collective, which needs the GIL, while the
main thread was finalizing). The launchers alternate run by run, so both see the same load on
a machine shared with other work. The table gives, per launcher, runs, aborts, other failures
(any other non-zero exit) and the exit codes seen.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
ABORT = "terminate called without an active exception"
CONFIG = {"wg_distribution": True, "mv_distribution": True, "format": ["csv"], "ops": ["norm", "max"]}
JOBS = {
    "hf_trainer": ["launcher_hf_trainer.py", "--output", "{tmp}/hf"],
    "async_tail": ["exit_async_tail.py"],
}
TWO_RANKS = ["--standalone", "--nproc-per-node", "2"]


def argv(launcher: str, job: list[str], config: str, tmp: str) -> list[str]:
    script = [os.path.join(SCRIPTS, job[0]), *(a.format(tmp=tmp) for a in job[1:])]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *TWO_RANKS, *script]
    monitor = [sys.executable, "-m", "msmon.launcher", "run", "--config", config, "--output-dir", f"{tmp}/out"]
    return [*monitor, *TWO_RANKS, "--", *script]


def one_run(launcher: str, job: list[str], config: str, timeout: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MSMON_", "TORCHELASTIC_", "MONITOR_"))}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        proc = subprocess.run(
            argv(launcher, job, config, tmp), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
        seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    return {"rc": proc.returncode, "abort": ABORT in output, "seconds": round(seconds, 1), "tail": output[-600:]}


def msmon_measured() -> str:
    """Which msmon `msmon run` used: its source directory and, in a git checkout, the commit."""
    found = subprocess.run(
        [sys.executable, "-c", "import msmon, os; print(os.path.dirname(msmon.__file__))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    rev = subprocess.run(["git", "-C", found, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{found} at {rev.stdout.strip()}" if rev.returncode == 0 else found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=16, help="runs per launcher")
    parser.add_argument("--launchers", nargs="+", default=["torchrun", "msmon"], choices=["torchrun", "msmon"])
    parser.add_argument("--job", default="hf_trainer", choices=sorted(JOBS))
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--json", help="write the runs and the table here")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.launchers}
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "monitor.json")
        with open(config, "w", encoding="utf-8") as fh:
            json.dump(CONFIG, fh)
        for i in range(args.runs):
            for launcher in args.launchers:
                result = one_run(launcher, JOBS[args.job], config, args.timeout)
                runs[launcher].append(result)
                flag = "ABORT" if result["abort"] else ("fail" if result["rc"] else "ok")
                print(f"run {i + 1:2d} {launcher:8s} rc={result['rc']} {flag} ({result['seconds']} s)", flush=True)
    table = {
        name: {
            "runs": len(results),
            "aborts": sum(r["abort"] for r in results),
            "other_failures": sum(bool(r["rc"]) and not r["abort"] for r in results),
            "exit_codes": sorted({r["rc"] for r in results}),
        }
        for name, results in runs.items()
    }
    print(f"\njob {args.job}, {args.runs} runs per launcher, {os.cpu_count()} CPUs")
    print(f"{'launcher':10s} {'runs':>5s} {'aborts':>7s} {'other':>6s}  exit codes")
    for name, row in table.items():
        print(f"{name:10s} {row['runs']:5d} {row['aborts']:7d} {row['other_failures']:6d}  {row['exit_codes']}")
    if args.json:
        import torch

        meta = {"job": args.job, "torch": torch.__version__, "python": platform.python_version()}
        meta.update(cpus=os.cpu_count(), msmon=msmon_measured())
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"meta": meta, "table": table, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()

"""What `make demo`'s job costs: the example trained plainly and under `msmon run`, step times
measured inside the training loop, revisions of msmon side by side.

    python benchmarks/demo_cost.py                                  # the working tree, 3 rounds
    python benchmarks/demo_cost.py --revs e60d5b5 9762c42 --rounds 3 --json out.json

Each round runs `benchmarks/timed_example.py` (the example's loop: DDP on gloo, 2 ranks, 2
micro-batches per step, AdamW) once under plain torchrun and once under `msmon run --config
examples/monitor.json` (the demo's full configuration) per revision, in fresh processes, one
after the other, so a round shares the machine's state of the moment. A revision other than the
working tree is checked out into a temporary git worktree and imported from there (PYTHONPATH).

Per run: the median step of each rank (after 5 warm-up steps), and the garbage collector's time
and collections over the same steps; per monitored run also what msmon reports about itself
(summary.json: its time on the training thread, the writer thread's CPU). The table gives, per
revision, the median over rounds of the monitored/plain step ratio of the same round.

The self-reported cost counts msmon's own code on the training thread. What it cannot see: the
writer thread's CPU on cores the training already fills (2 ranks on 2 cores here), and the
collections that msmon's objects cause but that run inside the training's own code. The ratio
to the plain run sees everything.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_job import ROOT, demo_command, demo_env  # noqa: E402

TIMED = ROOT / "benchmarks" / "timed_example.py"
WORKTREE = "worktree"


def run_job(args: list[str], env: dict[str, str], ranks: int) -> list[dict[str, Any]]:
    """The ranks' TIMED results of one job (run again once if a rank printed none: torch 2.13's
    gloo now and then aborts a rank in its teardown, after its work is done)."""
    for _ in range(2):
        done = subprocess.run(args, env=env, capture_output=True, text=True)
        # the ranks share one stdout, so one rank's line may follow another's on the same line
        found = re.findall(r"TIMED (\{[^{}]*\})", done.stdout)
        if len(found) == ranks:
            return sorted((json.loads(text) for text in found), key=lambda r: r["rank"])
    raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def plain(steps: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(TIMED), "--steps", str(steps)]
    return summarize(run_job(args, env, 2), None)


def monitored(src: Path, steps: int) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="msmon-demo-cost-"))
    try:
        env = demo_env(src, out)
        args = demo_command(TIMED, "--steps", str(steps))
        ranks = run_job(args, env, 2)
        summaries = []
        for path in sorted(glob.glob(str(out / "*-rank*" / "summary.json"))):
            with open(path, encoding="utf-8") as fh:
                summaries.append(json.load(fh))
        return summarize(ranks, summaries)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def summarize(ranks: list[dict[str, Any]], summaries: list[dict[str, Any]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "step_ms": statistics.mean(r["step_ms"] for r in ranks),
        "gc_ms_per_step": statistics.mean(r["gc_ms_per_step"] for r in ranks),
        "gc_full_collections": sum(r["gc_collections"][2] for r in ranks) / len(ranks),
        "gc_longest_ms": max(r["gc_longest_ms"] for r in ranks),
        "ranks": ranks,
    }
    if summaries:
        out["self_reported_pct"] = statistics.mean(s["monitor_cost_pct"] for s in summaries)
        out["monitor_ms_per_step"] = statistics.mean(s["monitor_ms_per_step"] for s in summaries)
        out["writer_cpu_ms_per_step"] = statistics.mean(s["writer_cpu_ms_per_step"] for s in summaries)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revs", nargs="+", default=[WORKTREE], help=f"git revisions ('{WORKTREE}': this tree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (5 are warm-up)")
    parser.add_argument("--json", help="write every run's results to this file")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="msmon-demo-cost-revs-"))
    sources: dict[str, Path] = {}
    try:
        for rev in args.revs:
            if rev == WORKTREE:
                sources[rev] = ROOT / "src"
                continue
            tree = work / rev.replace("/", "_")
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                check=True,
                capture_output=True,
            )
            sources[rev] = tree / "src"
        rounds = []
        for number in range(args.rounds):
            result = {"plain": plain(args.steps)}
            for rev, src in sources.items():
                result[rev] = monitored(src, args.steps)
            rounds.append(result)
            print(f"round {number + 1}: plain {result['plain']['step_ms']:.1f} ms", file=sys.stderr, flush=True)
    finally:
        for rev in sources:
            if rev != WORKTREE:
                tree = sources[rev].parent
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    print(table(rounds, list(sources)))
    print(f"\n{cpu_model()}, {os.cpu_count()} cores; {args.rounds} rounds of {args.steps} steps")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"cpu": cpu_model(), "steps": args.steps, "rounds": rounds}, fh, indent=1)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(rounds: list[dict[str, Any]], revs: list[str]) -> str:
    def med(values: list[float]) -> str:
        return f"{statistics.median(values):.1f}"

    columns = ["run", "step (median of rounds)", "ratio to plain (range)", "self-reported", "writer CPU/step"]
    columns += ["GC ms/step", "full GCs per run", "longest GC"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    plain_runs = [r["plain"] for r in rounds]
    lines.append(
        f"| plain | {med([p['step_ms'] for p in plain_runs])} ms | | | | "
        f"{med([p['gc_ms_per_step'] for p in plain_runs])} | {med([p['gc_full_collections'] for p in plain_runs])} | "
        f"{med([p['gc_longest_ms'] for p in plain_runs])} ms |"
    )
    for rev in revs:
        runs = [r[rev] for r in rounds]
        ratios = [r[rev]["step_ms"] / r["plain"]["step_ms"] for r in rounds]
        lines.append(
            f"| {rev} | {med([m['step_ms'] for m in runs])} ms | ×{statistics.median(ratios):.3f} "
            f"({min(ratios):.2f}–{max(ratios):.2f}) | {med([m['self_reported_pct'] for m in runs])} % "
            f"({med([m['monitor_ms_per_step'] for m in runs])} ms) | "
            f"{med([m['writer_cpu_ms_per_step'] for m in runs])} ms | "
            f"{med([m['gc_ms_per_step'] for m in runs])} | {med([m['gc_full_collections'] for m in runs])} | "
            f"{med([m['gc_longest_ms'] for m in runs])} ms |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

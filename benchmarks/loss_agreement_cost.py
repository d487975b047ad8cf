"""What loss_distribution and grad_agreement add to the wg configuration, on 2 DDP ranks.

    python benchmarks/loss_agreement_cost.py --rounds 6 --steps 40 --json results.json

The gradient agreement exists only under data parallelism, so this runs the reference model
(gpt-3.7M of workloads.py, AdamW, msprobe's six ops, CSV) under DDP on 2 gloo ranks, one
torch thread each, monitored with `wg`, `wg+loss` and `wg+agreement` (workloads.CONFIGS). One
job per configuration and round, each its own torchrun; the configurations take turns round
after round (the order rotates), so a load that comes and goes on a shared machine falls on
all of them. A job's figures are its ranks' medians of the timed steps: the step's wall time,
the training thread's CPU time (what a load on the machine disturbs least: time spent waiting
for the CPU or for gloo is not counted), and the monitor's own clock on the training thread
(summary `monitor_seconds`). The
comparison is paired: each configuration against the wg job of the same round, as a
percentage of that wg step; the table gives the median of the rounds and their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
CHOICES = ("wg", "wg+loss", "wg+agreement")


def inner(args: argparse.Namespace) -> None:
    """One rank of one job: DDP, warm-up, timed steps; writes its figures to a file."""
    import torch
    import torch.distributed as dist
    from workloads import MODELS, monitor_config, train_step

    from msmon import TrainerMon

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = MODELS[args.model]
    torch.manual_seed(0)
    model = spec.build()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = os.path.join(args.workdir, "monitor.json")
    if rank == 0:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(monitor_config(args.inner, model), fh)
    dist.barrier()
    monitor = TrainerMon(path)
    monitor.set_monitor(ddp, optimizer)
    gen = torch.Generator().manual_seed(rank)
    device = torch.device("cpu")
    times, cpu = [], []
    for step in range(args.warmup + args.steps):
        batch = spec.batch_of(gen, device)
        started, started_cpu = time.perf_counter(), time.thread_time()
        train_step(ddp, optimizer, batch)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - started_cpu)
    summary = monitor.summary()
    monitor.close()
    result = {
        "step_ms": 1e3 * statistics.median(times),
        "step_cpu_ms": 1e3 * statistics.median(cpu),
        "monitor_ms_per_step": 1e3 * summary["monitor_seconds"] / (args.warmup + args.steps),
    }
    with open(os.path.join(args.workdir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


def job(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun of `config`; the mean over ranks of their figures."""
    with tempfile.TemporaryDirectory() as workdir:
        env = dict(os.environ, MONITOR_OUTPUT_DIR=os.path.join(workdir, "out"), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += [os.path.abspath(__file__), "--inner", config, "--workdir", workdir, "--model", args.model]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{config}: torchrun failed\n{proc.stderr[-3000:]}")
        ranks = []
        for rank in (0, 1):
            with open(os.path.join(workdir, f"rank{rank}.json"), encoding="utf-8") as fh:
                ranks.append(json.load(fh))
    return {key: statistics.mean(r[key] for r in ranks) for key in ranks[0]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):+.2f} % (min {min(values):+.2f}, max {max(values):+.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", default="gpt-3.7M")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", help="write every job's figures to this file")
    parser.add_argument("--inner", choices=CHOICES, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args)
        return
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = list(CHOICES[r % len(CHOICES) :] + CHOICES[: r % len(CHOICES)])
        found = {"order": order, "load": os.getloadavg()[0]}
        for config in order:
            found[config] = job(config, args)
        print(f"round {r}: " + ", ".join(f"{c} {found[c]['step_ms']:.1f} ms" for c in CHOICES), file=sys.stderr)
        rounds.append(found)
    print(f"{args.model}, DDP 2 gloo ranks, 1 thread each, {args.steps} timed steps per job, {args.rounds} rounds")
    wg_steps = [r["wg"]["step_ms"] for r in rounds]
    print(f"wg step: median {statistics.median(wg_steps):.1f} ms (rounds {min(wg_steps):.1f} to {max(wg_steps):.1f})")
    wg_cpu = [r["wg"]["step_cpu_ms"] for r in rounds]
    print(f"wg step, training thread CPU time: median {statistics.median(wg_cpu):.1f} ms")
    for config in CHOICES[1:]:
        wall = [100 * (r[config]["step_ms"] - r["wg"]["step_ms"]) / r["wg"]["step_ms"] for r in rounds]
        cpu = [100 * (r[config]["step_cpu_ms"] - r["wg"]["step_cpu_ms"]) / r["wg"]["step_cpu_ms"] for r in rounds]
        own = [
            100 * (r[config]["monitor_ms_per_step"] - r["wg"]["monitor_ms_per_step"]) / r["wg"]["step_ms"]
            for r in rounds
        ]
        print(f"{config} - wg, step wall time: {spread(wall)} of the wg step")
        print(f"{config} - wg, training thread CPU time per step: {spread(cpu)} of the wg step's")
        print(f"{config} - wg, monitor's own clock on the training thread: {spread(own)} of the wg step")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"model": args.model, "steps": args.steps, "rounds": rounds}, fh, indent=2)


if __name__ == "__main__":
    main()

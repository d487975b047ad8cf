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

    python benchmarks/loss_agreement_cost.py --paired 150 --json results.json

measures the agreement's own cost paired in one process instead: one DDP job on 2 ranks,
monitored with `wg+agreement`, whose gradient collector records the agreement on one step of
each pair and not on the other (its `agreeing` switch; the order alternates pair by pair), so
both halves of a pair share the process, its caches and the machine's load of the moment. Per
pair, the difference of the two steps' training-thread CPU time and wall time; the figures are
the medians over the pairs, as a percentage of the median step without the agreement.
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


def grad_collector(monitor: Any) -> Any:
    """The monitor's gradient collector (the one that records the agreement)."""
    from msmon.collectors.grads.collector import GradCollector

    return next(c for c in monitor.runner.built.collectors if isinstance(c, GradCollector))


def _monitored_ddp(args: argparse.Namespace, config: str) -> tuple[Any, Any, Any, int, Any]:
    """This rank's part of the job: the reference model under DDP (gloo, one thread), AdamW, the
    monitor attached with `config` (workloads.monitor_config); (model spec, DDP module,
    optimizer, rank, monitor)."""
    import torch
    import torch.distributed as dist
    from workloads import MODELS, monitor_config

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
            json.dump(monitor_config(config, model), fh)
    dist.barrier()
    monitor = TrainerMon(path)
    monitor.set_monitor(ddp, optimizer)
    return spec, ddp, optimizer, rank, monitor


def inner(args: argparse.Namespace) -> None:
    """One rank of one job: DDP, warm-up, timed steps; writes its figures to a file."""
    import torch
    import torch.distributed as dist
    from workloads import train_step

    spec, ddp, optimizer, rank, monitor = _monitored_ddp(args, args.inner)
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


def inner_paired(args: argparse.Namespace) -> None:
    """One rank of the paired job: `args.paired` pairs of steps, the agreement on in one of each."""
    import torch
    import torch.distributed as dist
    from workloads import train_step

    spec, ddp, optimizer, rank, monitor = _monitored_ddp(args, "wg+agreement")
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.warmup):
        train_step(ddp, optimizer, spec.batch_of(gen, torch.device("cpu")))
    collector = grad_collector(monitor)
    assert collector.agreeing, "the agreement is not recorded in this job"
    pairs: list[dict[str, float]] = []
    for p in range(args.paired):
        found: dict[str, float] = {}
        for on in (True, False) if p % 2 == 0 else (False, True):
            collector.agreeing = on
            batch = spec.batch_of(gen, torch.device("cpu"))
            started, started_cpu = time.perf_counter(), time.thread_time()
            train_step(ddp, optimizer, batch)
            found[f"{'on' if on else 'off'}_ms"] = 1e3 * (time.perf_counter() - started)
            found[f"{'on' if on else 'off'}_cpu_ms"] = 1e3 * (time.thread_time() - started_cpu)
        pairs.append(found)
    collector.agreeing = True
    monitor.close()
    with open(os.path.join(args.workdir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(pairs, fh)
    dist.destroy_process_group()


def paired(args: argparse.Namespace) -> None:
    """The paired job (module docstring) and its figures."""
    with tempfile.TemporaryDirectory() as workdir:
        env = dict(os.environ, MONITOR_OUTPUT_DIR=os.path.join(workdir, "out"), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += [os.path.abspath(__file__), "--inner-paired", "--paired", str(args.paired), "--workdir", workdir]
        cmd += ["--model", args.model, "--warmup", str(args.warmup)]
        load_before = os.getloadavg()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        load_after = os.getloadavg()
        if proc.returncode != 0:
            raise RuntimeError(f"paired job: torchrun failed\n{proc.stderr[-3000:]}")
        ranks = []
        for rank in (0, 1):
            with open(os.path.join(workdir, f"rank{rank}.json"), encoding="utf-8") as fh:
                ranks.append(json.load(fh))
    print(f"{args.model}, DDP 2 gloo ranks, 1 thread each, wg+agreement with the agreement on in one step of each pair")
    print(f"{args.paired} pairs per rank; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    summary: dict[str, Any] = {"model": args.model, "pairs": args.paired, "load": [load_before, load_after]}
    for rank, pairs in enumerate(ranks):
        for clock, key in (("training thread CPU time", "cpu_ms"), ("wall time", "ms")):
            off = statistics.median(p[f"off_{key}"] for p in pairs)
            diffs = [p[f"on_{key}"] - p[f"off_{key}"] for p in pairs]
            cost = statistics.median(diffs)
            q = statistics.quantiles(diffs, n=4)
            print(
                f"rank {rank}, {clock}: step without {off:.1f} ms; the agreement adds {cost:+.2f} ms "
                f"(quartiles {q[0]:+.2f} to {q[2]:+.2f}) = {100 * cost / off:+.2f} % of the step"
            )
            summary[f"rank{rank}_{key}"] = {"off_median": off, "added_median": cost, "quartiles": [q[0], q[2]]}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({**summary, "ranks": ranks}, fh, indent=2)


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
    parser.add_argument("--paired", type=int, default=0, help="pairs of steps in one job (module docstring)")
    parser.add_argument("--inner", choices=CHOICES, help=argparse.SUPPRESS)
    parser.add_argument("--inner-paired", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner_paired:
        inner_paired(args)
        return
    if args.inner:
        inner(args)
        return
    if args.paired:
        paired(args)
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

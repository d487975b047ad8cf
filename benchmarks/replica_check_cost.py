"""What the replica check costs on a check step, on the reference model under DDP.

    python benchmarks/replica_check_cost.py                      # gpt-3.7M, 2 gloo ranks, 5 repeats
    python benchmarks/replica_check_cost.py --model gpt-58M --json out.json

Each rank trains the benchmark's model (workloads.py) under DistributedDataParallel with AdamW
and a TrainerMon whose only feature is the replica check, in three settings: off, weights every
step, weights and reduced gradients every step. Per step it records the CPU time the check takes on the training thread (fingerprint kernels, the
host copy, the hand-off: robust to other processes on the machine), the monitor's own clock
(wall time, which includes being preempted) and the step's wall and CPU time. It also times the pieces alone: the fingerprints of all
weights, and the exchange the background thread does (one all_gather of the fingerprints on
msmon's gloo group). Every measurement is repeated (--repeats): the table gives the median of
the repeats' medians and their range, since the machine may be shared with other work.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workloads import MODELS, train_step  # noqa: E402

SETTINGS = {
    "off": None,
    "weights": {"enable": True, "every": 1},
    "weights+grads": {"enable": True, "every": 1, "grads": True},
}


def timed(fn, count: int) -> tuple[float, float]:
    """Median wall and training-thread CPU milliseconds of `count` calls (CPU time is robust
    to other processes taking the cores)."""
    wall, cpu = [], []
    for _ in range(count):
        started, started_cpu = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def cpu_clocked(fn, total: list[float]):
    """fn, adding the training thread's CPU time spent in it to total[0]."""

    def clocked() -> None:
        started = time.thread_time()
        try:
            fn()
        finally:
            total[0] += time.thread_time() - started

    return clocked


def worker(rank: int, world: int, init: str, args: argparse.Namespace, results: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from msmon import TrainerMon
    from msmon.collectors.replica_check.group import own_group
    from msmon.stats.fingerprint import Fingerprinter

    spec = MODELS[args.model]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(spec.build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    work = tempfile.mkdtemp(prefix=f"msmon-replica-bench-{rank}-")
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(work, "out")
    out: dict[str, Any] = {"steps": {}, "alone": {}}
    for repeat in range(args.repeats):
        for name, setting in SETTINGS.items():
            config = os.path.join(work, f"{name}.json")
            with open(config, "w", encoding="utf-8") as fh:
                json.dump({"format": "csv", **({"replica_check": setting} if setting else {})}, fh)
            mon = TrainerMon(config)
            mon.set_monitor(model, optimizer)
            check_cpu = [0.0]
            for collector in mon.collectors:  # the check's own CPU time on the training thread
                for phase in ("before_update", "after_update"):
                    setattr(collector, phase, cpu_clocked(getattr(collector, phase), check_cpu))
            monitor_ms, check_cpu_ms, step_ms, step_cpu_ms = [], [], [], []
            for step in range(args.warmup + args.steps):
                before, before_cpu = mon.ctx.cost.seconds, check_cpu[0]
                started, started_cpu = time.perf_counter(), time.thread_time()
                train_step(model, optimizer, spec.batch_of(gen, torch.device("cpu")))
                if step >= args.warmup:
                    step_ms.append(1e3 * (time.perf_counter() - started))
                    step_cpu_ms.append(1e3 * (time.thread_time() - started_cpu))
                    monitor_ms.append(1e3 * (mon.ctx.cost.seconds - before))
                    check_cpu_ms.append(1e3 * (check_cpu[0] - before_cpu))
            mon.close()
            out["steps"].setdefault(name, []).append(
                {
                    "monitor_ms": statistics.median(monitor_ms),
                    "check_cpu_ms": statistics.median(check_cpu_ms),
                    "step_ms": statistics.median(step_ms),
                    "step_cpu_ms": statistics.median(step_cpu_ms),
                }
            )
        fp = Fingerprinter()
        params = list(model.parameters())
        fp(params)  # tables and plan
        wall, cpu = timed(lambda: fp(params), args.steps)  # noqa: B023
        out["alone"].setdefault("fingerprint_weights_ms", []).append(wall)
        out["alone"].setdefault("fingerprint_weights_cpu_ms", []).append(cpu)
        group = own_group(list(range(world)))
        payload = torch.zeros(2 + 2 * len(params), dtype=torch.int64)
        buffers = [torch.empty_like(payload) for _ in range(world)]
        dist.barrier()
        wall, cpu = timed(lambda: dist.all_gather(buffers, payload, group=group), args.steps)  # noqa: B023
        out["alone"].setdefault("exchange_ms", []).append(wall)
    out["tensors"] = len(params)
    out["elements"] = sum(p.numel() for p in params)
    if rank == 0:
        with open(results, "w", encoding="utf-8") as fh:
            json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ms ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-3.7M")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per setting and repeat")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    os.environ.setdefault("MSMON_LOG_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        load = os.getloadavg()
        mp.spawn(worker, args=(args.ranks, f"file://{tmp}/store", args, results), nprocs=args.ranks)
        with open(results, encoding="utf-8") as fh:
            out = json.load(fh)
    out.update(
        model=args.model,
        ranks=args.ranks,
        repeats=args.repeats,
        measured_steps=args.steps,
        load_before=load,
        load_after=os.getloadavg(),
        cpu=platform.processor(),
        torch=torch.__version__,
    )
    print(
        f"{args.model}: {out['tensors']} tensors, {out['elements']:,} elements; {args.ranks} gloo ranks, "
        f"{args.repeats} repeats of {args.steps} steps; load {load[0]:.2f} before, {out['load_after'][0]:.2f} after"
    )
    print(
        "| setting | the check's CPU time per check step (training thread) | monitor's clock (wall) | step wall | "
        "step CPU |"
    )
    print("|---|---|---|---|---|")
    for name in SETTINGS:
        rows = out["steps"][name]
        print(
            f"| {name} | {summary([r['check_cpu_ms'] for r in rows])} | {summary([r['monitor_ms'] for r in rows])} | "
            f"{summary([r['step_ms'] for r in rows])} | {summary([r['step_cpu_ms'] for r in rows])} |"
        )
    alone = out["alone"]
    print(
        f"fingerprints of all weights alone: {summary(alone['fingerprint_weights_ms'])} wall, "
        f"{summary(alone['fingerprint_weights_cpu_ms'])} CPU; exchange (all_gather on the gloo group, in the "
        f"background thread): {summary(alone['exchange_ms'])} wall"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

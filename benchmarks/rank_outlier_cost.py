"""What AnomalyRankOutlier costs, on the reference model under DDP, against the wg configuration.

    python benchmarks/rank_outlier_cost.py                  # gpt-3.7M, 3 gloo ranks, 4 repeats
    python benchmarks/rank_outlier_cost.py --ranks 4 --json out.json

Each rank trains the benchmark's model (workloads.py) under DistributedDataParallel with AdamW,
monitored with the wg configuration (`wg_distribution`) and `loss_distribution` (the rows the
rule reads its loss from), with and without the rule, the two settings alternating repeat after
repeat. The rule needs two ranks at least (with two, only its own-history test runs;
from three, the median test too). Per step it records the step's
wall and training-thread CPU time, the monitor's own clock on the training thread, the writer
thread's CPU time, and the rule's own CPU time on each thread it uses (training: its setup
check; writer: reading the rank's statistics and loss from the step's rows; exchange: the
gather and the two tests), which other processes on a shared machine cannot inflate. The 5-number all_gather
on msmon's gloo group is also timed alone.
The table gives the median of the repeats' medians and their range.
"""

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
from workloads import MODELS, monitor_config, train_step  # noqa: E402

# nan_origin, on by default with any alert rule, is kept off: it hooks every module, and is not the rule's cost
RULE = {"alert": {"rules": [{"rule_name": "AnomalyRankOutlier"}]}, "nan_origin": False}
LOSS = {"loss_distribution": True}  # in both settings: the rule's loss is read from these rows
BASE, WITH_RULE = "wg+loss", "wg+loss+AnomalyRankOutlier"
SETTINGS = {BASE: LOSS, WITH_RULE: {**LOSS, **RULE}}


def worker(rank: int, world: int, init: str, args: argparse.Namespace, results: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from msmon import TrainerMon
    from msmon.collectors.rank_outlier import collector as rule
    from msmon.collectors.replica_check.group import exchange, own_group

    spent = {"training": [0.0], "writer": [0.0], "exchange": [0.0]}  # the rule's CPU seconds, by thread
    rule.RankOutlierCollector.after_update = cpu_clocked(rule.RankOutlierCollector.after_update, spent["training"])
    rule.StatisticsConsumer.consume = cpu_clocked(rule.StatisticsConsumer.consume, spent["writer"])
    rule.RankOutlierCollector._compare = cpu_clocked(rule.RankOutlierCollector._compare, spent["exchange"])

    spec = MODELS[args.model]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(spec.build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    work = tempfile.mkdtemp(prefix=f"msmon-outlier-bench-{rank}-")
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(work, "out")
    out: dict[str, Any] = {"steps": {}, "alone": {}}
    for _repeat in range(args.repeats):
        for name, extra in SETTINGS.items():
            config = os.path.join(work, f"{name}.json")
            with open(config, "w", encoding="utf-8") as fh:
                json.dump({**monitor_config("wg", model.module), **extra}, fh)
            mon = TrainerMon(config)
            mon.set_monitor(model, optimizer)
            monitor_ms, step_ms, step_cpu_ms = [], [], []
            writer_cpu = 0.0
            rule_before = {k: 0.0 for k in spent}
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    mon.output.writer.drain()
                    writer_cpu = mon.output.writer.cpu_seconds
                    rule_before = {k: v[0] for k, v in spent.items()}
                before = mon.ctx.cost.seconds
                started, started_cpu = time.perf_counter(), time.thread_time()
                batch = spec.batch_of(gen, torch.device("cpu"))
                loss = train_step(model, optimizer, batch)
                if step >= args.warmup:
                    step_ms.append(1e3 * (time.perf_counter() - started))
                    step_cpu_ms.append(1e3 * (time.thread_time() - started_cpu))
                    monitor_ms.append(1e3 * (mon.ctx.cost.seconds - before))
                del loss
            mon.output.writer.drain()
            writer_ms = 1e3 * (mon.output.writer.cpu_seconds - writer_cpu) / args.steps
            mon.close()  # waits for the last comparisons
            dist.barrier()
            rule_ms = {k: 1e3 * (v[0] - rule_before[k]) / args.steps for k, v in spent.items()}
            out["steps"].setdefault(name, []).append(
                {
                    "monitor_ms": statistics.median(monitor_ms),
                    "step_ms": statistics.median(step_ms),
                    "step_cpu_ms": statistics.median(step_cpu_ms),
                    "writer_cpu_ms": writer_ms,
                    **{f"rule_{k}_cpu_ms": v for k, v in rule_ms.items()},
                }
            )
        group = own_group(list(range(world)), "rank_outlier")
        payload = torch.zeros(5, dtype=torch.float64)
        dist.barrier()
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            exchange(payload, group, world)
            times.append(1e3 * (time.perf_counter() - started))
        out["alone"].setdefault("gather_ms", []).append(statistics.median(times))
    if rank == 0:
        with open(results, "w", encoding="utf-8") as fh:
            json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


def cpu_clocked(fn, total: list[float]):
    """fn, adding the CPU time of the thread that runs it to total[0]."""

    def clocked(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.thread_time() - started

    return clocked


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ms ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-3.7M")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15, help="measured steps per setting and repeat")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=4)
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
        cores=os.cpu_count(),
        torch=torch.__version__,
    )
    print(
        f"{args.model}: {args.ranks} gloo ranks on {out['cores']} cores, {args.repeats} repeats of {args.steps} "
        f"steps; load {load[0]:.2f} before, {out['load_after'][0]:.2f} after"
    )
    print("| setting | step wall | step CPU (training thread) | monitor's clock (training thread) | writer CPU/step |")
    print("|---|---|---|---|---|")
    for name in SETTINGS:
        rows = out["steps"][name]
        print(
            f"| {name} | {summary([r['step_ms'] for r in rows])} | {summary([r['step_cpu_ms'] for r in rows])} | "
            f"{summary([r['monitor_ms'] for r in rows])} | {summary([r['writer_cpu_ms'] for r in rows])} |"
        )
    base, rule = out["steps"][BASE], out["steps"][WITH_RULE]
    print(
        "the rule's own CPU time per step: training thread "
        f"{summary([r['rule_training_cpu_ms'] for r in rule])}, writer thread "
        f"{summary([r['rule_writer_cpu_ms'] for r in rule])}, exchange thread (gather and test) "
        f"{summary([r['rule_exchange_cpu_ms'] for r in rule])}"
    )
    step_cpu = statistics.median(r["step_cpu_ms"] for r in base)
    training = statistics.median(r["rule_training_cpu_ms"] for r in rule)
    print(f"training-thread share: {100 * training / step_cpu:.3f} % of the {BASE} step's CPU time ({step_cpu:.1f} ms)")
    ratios = [r["step_ms"] / b["step_ms"] for b, r in zip(base, rule)]
    print(f"step wall, rule / wg+loss, per repeat: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"the 5-number all_gather alone (background thread): {summary(out['alone']['gather_ms'])} wall")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

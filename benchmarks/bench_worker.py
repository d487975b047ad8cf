"""One benchmark measurement in its own process (so peak RSS belongs to it alone).

    python bench_worker.py --tool msmon --model gpt-3.7M --config wg --pairs 30
    python bench_worker.py --tool msmon --model gpt-3.7M --config wg --memory monitored

Paired mode: two copies of the model with the same initial weights, one monitored, stepped
alternately on the same batches (the order flips every pair, so drift, cache warmth and the
writer thread's leftovers fall on both sides); the result is the ratio of each pair's step
times. Memory mode: one copy only, monitored or plain, for the process's peak RSS.

Runs under msmon's venv or msprobe's (`--tool msprobe`); it prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sync_check import check_no_syncs  # noqa: E402
from workloads import MODELS, monitor_config, train_step  # noqa: E402


def attach(tool: str, config: dict[str, Any], model: torch.nn.Module, optimizer, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "monitor.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    os.environ["MONITOR_OUTPUT_DIR"] = os.path.join(workdir, "out")
    if tool == "msmon":
        from msmon import TrainerMon
    else:
        from msprobe.pytorch import TrainerMon
    monitor = TrainerMon(path, params_have_main_grad=False)
    monitor.set_monitor(model, optimizer)
    return monitor


def thread_cpu_seconds(name_prefix: str) -> float:
    """CPU time of this process's Python threads whose name starts with the prefix."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():
        if thread.name.startswith(name_prefix) and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/stat", encoding="ascii") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / ticks
            except OSError:
                pass
    return total


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_pairs(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    spec = MODELS[args.model]
    device = torch.device(args.device)
    torch.manual_seed(0)
    plain = spec.build().to(device)
    monitored = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    opt_mon = torch.optim.AdamW(monitored.parameters(), lr=1e-3)
    config = monitor_config(args.config, monitored, args.ops)
    monitor = attach(args.tool, config, monitored, opt_mon, workdir)
    if os.environ.get("BENCH_NICE_WRITER"):  # experiment: the writer thread at the lowest priority
        for thread in threading.enumerate():
            if thread.name.startswith("msmon-writer") and thread.native_id:
                os.setpriority(os.PRIO_PROCESS, thread.native_id, 19)
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(model, opt, batch) -> tuple[float, float, torch.Tensor]:
        """Wall time, the training thread's CPU time, and the loss of one step."""
        sync()
        start, cpu = time.perf_counter(), time.thread_time()
        loss = train_step(model, opt, batch)
        sync()
        return time.perf_counter() - start, time.thread_time() - cpu, loss

    ratios, cpu_ratios, plain_s, mon_s = [], [], [], []
    identical = True
    for i in range(args.warmup + args.pairs):
        batch = spec.batch_of(gen, device)
        if i % 2 == 0:
            tp, cp, lp = timed(plain, opt_plain, batch)
            tm, cm, lm = timed(monitored, opt_mon, batch)
        else:
            tm, cm, lm = timed(monitored, opt_mon, batch)
            tp, cp, lp = timed(plain, opt_plain, batch)
        identical = identical and torch.equal(lp, lm)
        if i >= args.warmup:
            ratios.append(tm / tp)
            cpu_ratios.append(cm / cp)
            plain_s.append(tp)
            mon_s.append(tm)
    steps = args.warmup + args.pairs
    sync_check = (
        check_no_syncs(args.tool, monitor, monitored, opt_mon, spec.batch_of(gen, device))
        if device.type == "cuda" or args.sync_check
        else None
    )
    writer_cpu = thread_cpu_seconds("msmon-writer") if args.tool == "msmon" else None
    summary = None
    if args.tool == "msmon":
        summary = monitor.summary()
        monitor.close()
        # the monitor's own clock relative to the monitored steps alone (its summary divides
        # by the wall time since attach, which here includes the plain copy's steps)
        summary["monitor_ms_per_step"] = 1e3 * summary["monitor_seconds"] / steps
    deciles = statistics.quantiles(ratios, n=10)
    return {
        "mode": "pairs",
        "tool": args.tool,
        "model": args.model,
        "config": args.config,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "pairs": args.pairs,
        "ops": config["ops"],
        "ratios": ratios,  # every pair's (overhead.py --against pools them across turns)
        "ratio_median": statistics.median(ratios),
        "ratio_p10": deciles[0],
        "ratio_p90": deciles[-1],
        "ratio_mean_of_sums": sum(mon_s) / sum(plain_s),
        # the training thread's CPU time: robust to other load, complete with one torch thread
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "plain_ms": 1e3 * statistics.median(plain_s),
        "monitored_ms": 1e3 * statistics.median(mon_s),
        "losses_identical": bool(identical),
        "writer_cpu_ms_per_step": None if writer_cpu is None else 1e3 * writer_cpu / steps,
        "monitor_summary": summary,
        "sync_check": sync_check,
        "params": sum(p.numel() for p in plain.parameters()),
        "native_stats": native_isa(args.tool),
    }


def native_isa(tool: str) -> str | None:
    """Which statistics path msmon used: the native kernel's loop ("avx2", "baseline") or None
    for torch reductions."""
    if tool != "msmon":
        return None
    import importlib

    for name in ("msmon.stats.native", "msmon.native"):  # the latter before the stats/ folder (27a2ae3)
        try:
            native = importlib.import_module(name)
        except ImportError:
            continue
        return native.isa() if native._loaded is not None else None
    return None


def run_memory(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    spec = MODELS[args.model]
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = spec.build().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = None
    if args.memory == "monitored":
        monitor = attach(args.tool, monitor_config(args.config, model, args.ops), model, opt, workdir)
    gen = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        train_step(model, opt, spec.batch_of(gen, device))
    if monitor is not None and args.tool == "msmon":
        monitor.close()
    result = {
        "mode": "memory",
        "tool": args.tool if monitor else "plain",
        "model": args.model,
        "config": args.config if monitor else None,
        "steps": args.steps,
        "peak_rss_mib": peak_rss_mib(),
    }
    if device.type == "cuda":
        result["peak_device_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", choices=["msmon", "msprobe"], default="msmon")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-3.7M")
    parser.add_argument("--config", default="wg")
    parser.add_argument("--ops", nargs="+", default=None)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="memory mode: steps to run")
    parser.add_argument("--memory", choices=["plain", "monitored"], default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--sync-check", action="store_true", help="check for host syncs on the CPU too (sync_check.py's stand-in)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="msmon-bench-") as workdir:
        result = run_memory(args, workdir) if args.memory else run_pairs(args, workdir)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Monitored against plain training in separate processes: what a user sees between two runs.

    python benchmarks/separate_processes.py                     # reference model, three configurations
    python benchmarks/separate_processes.py --configs all_xy --rounds 8 --json out.json

overhead.py steps a monitored and a plain copy of the model alternately in one process, which
cancels the machine's drift but cannot see what msmon does to the whole process: the plain
copy runs beside msmon's threads too. This script runs each (configuration, plain or
monitored) in a fresh process, alternating them round after round; each process reports the
median of its timed steps and its OS thread count (msmon's own threads included). The
overhead is the median over rounds of monitored / plain from the same round.

Found this way (docs/performance.md, fifth round): msmon's writer thread once started an
OpenMP team of its own, which slowed every step of the process by half, the plain copy of
the paired benchmark included.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from overhead import machine  # noqa: E402

WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from workloads import MODELS, monitor_config, train_step
torch.set_num_threads(int(sys.argv[4]))
spec = MODELS[sys.argv[2]]
torch.manual_seed(0)
model = spec.build()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(0)
batches = [spec.batch_of(gen, torch.device("cpu")) for _ in range(8)]
monitor = None
if sys.argv[3] != "plain":
    from msmon import TrainerMon
    path = os.path.join(os.environ["MONITOR_OUTPUT_DIR"], "monitor.json")
    with open(path, "w") as fh:
        json.dump(monitor_config(sys.argv[3], model), fh)
    monitor = TrainerMon(path)
    monitor.set_monitor(model, optimizer)
for i in range(int(sys.argv[5])):
    train_step(model, optimizer, batches[i % 8])
times = []
for i in range(int(sys.argv[6])):
    started = time.perf_counter()
    train_step(model, optimizer, batches[i % 8])
    times.append(time.perf_counter() - started)
threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
if monitor is not None:
    monitor.close()
times.sort()
print(json.dumps({"step_ms": times[len(times) // 2] * 1e3, "os_threads": threads}))
"""


def run_one(model: str, config: str, threads: int, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "MONITOR_OUTPUT_DIR": out}
        done = subprocess.run(
            [sys.executable, "-c", WORKER, HERE, model, config, str(threads), str(warmup), str(steps)],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{config}: worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-3.7M")
    parser.add_argument("--configs", nargs="+", default=["wg", "wg+mv+param", "all_xy"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    results: dict = {"machine": machine(), "load_before": load_before, "runs": {}}
    for config in args.configs:
        plain, monitored, ratios = [], [], []
        for _ in range(args.rounds):
            p = run_one(args.model, "plain", args.threads, args.warmup, args.steps)
            m = run_one(args.model, config, args.threads, args.warmup, args.steps)
            plain.append(p)
            monitored.append(m)
            ratios.append(m["step_ms"] / p["step_ms"])
        results["runs"][config] = {"plain": plain, "monitored": monitored, "ratios": ratios}
        print(
            f"{args.model} {config:12s} plain {statistics.median(r['step_ms'] for r in plain):7.2f} ms "
            f"({plain[-1]['os_threads']} threads)  monitored {statistics.median(r['step_ms'] for r in monitored):7.2f} "
            f"ms ({monitored[-1]['os_threads']} threads)  ratio x{statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )
    results["load_after"] = os.getloadavg()[0]
    results["finished"] = time.time()
    print(f"load average {load_before:.2f} before, {results['load_after']:.2f} after; {args.rounds} rounds")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()

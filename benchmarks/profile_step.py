"""Where a monitored step's time goes: counted, not guessed.

    python benchmarks/profile_step.py --model gpt-3.7M --configs wg "wg+mv+param" all_xy

For one monitored step after warm-up, per configuration:

- Python hook calls: entries into msmon code from outside it (sys.setprofile);
- host reads in monitor code: `.item()`, `.tolist()`, `.cpu()`, `.numpy()` called from msmon
  frames (on an accelerator each would be a sync; on the CPU they wait for nothing);
- kernels: top-level aten ops launched from msmon code (torch.profiler with Python stacks),
  with their self CPU time grouped by op;
- bytes the statistics read (every tensor handed to msmon.stats, numel x element size) and
  the floor they imply at the machine's measured read bandwidth;
- step times: plain and monitored (median of alternating steps) and the monitor's summary().
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_worker import attach  # noqa: E402
from workloads import CONFIGS, MODELS, monitor_config, train_step  # noqa: E402

import msmon  # noqa: E402
import msmon.stats.engine  # noqa: E402
import msmon.stats.signs  # noqa: E402

MSMON_DIR = os.path.dirname(os.path.abspath(msmon.__file__))
HOST_READS = {"item", "tolist", "cpu", "numpy"}


def read_bandwidth_gbs(mib: int = 512) -> float:
    """Best-of-5 bandwidth of a sum over a tensor far larger than the caches."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


class CallCounter:
    """Counts entries into msmon code from outside it, and host reads made by msmon code."""

    def __init__(self) -> None:
        self.entries: collections.Counter = collections.Counter()
        self.host_reads: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        in_msmon = frame.f_code.co_filename.startswith(MSMON_DIR)
        if event == "call" and in_msmon:
            caller = frame.f_back
            if caller is None or not caller.f_code.co_filename.startswith(MSMON_DIR):
                self.entries[frame.f_code.co_name] += 1
        elif event == "c_call" and in_msmon and getattr(arg, "__name__", "") in HOST_READS:
            self.host_reads[arg.__name__] += 1

    def __enter__(self) -> CallCounter:
        sys.setprofile(self)
        threading.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


class BytesCounter:
    """Counts the bytes of every tensor msmon.stats reduces: each passes its input
    preparation once (`_as_stat_input`), which this wraps for one step."""

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self.repeat_bytes = 0  # the same tensor, unmodified, read again in the step
        self.repeats = 0
        self._seen: dict[tuple[int, int, int], Any] = {}
        self._original = msmon.stats.engine._as_stat_input

    def __enter__(self) -> BytesCounter:
        original = self._original

        def counting(t):
            prepared = original(t)
            size = prepared.numel() * prepared.element_size()
            self.tensors += 1
            self.bytes += size
            key = (id(t), t.data_ptr(), t._version)
            if key in self._seen and self._seen[key] is t:
                self.repeats += 1
                self.repeat_bytes += size
            self._seen[key] = t  # kept alive for the step, so ids cannot be reused meanwhile
            return prepared

        msmon.stats.engine._as_stat_input = msmon.stats.signs._as_stat_input = counting  # its two users
        return self

    def __exit__(self, *exc) -> None:
        msmon.stats.engine._as_stat_input = msmon.stats.signs._as_stat_input = self._original


def monitor_ops(prof) -> tuple[int, collections.Counter, collections.Counter]:
    """Top-level aten ops (no aten op above them) called from msmon code, found by walking up
    the profiler's event tree (with_stack puts Python frames like `msmon/stats/reductions.py(176): _one`
    in it): their count, and per op name the count and total CPU time (us) including children."""
    counts: collections.Counter = collections.Counter()
    times: collections.Counter = collections.Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        from_msmon, nested = False, False
        parent = event.cpu_parent
        while parent is not None:
            nested = nested or parent.name.startswith("aten::")
            from_msmon = from_msmon or "msmon/" in parent.name
            parent = parent.cpu_parent
        if from_msmon and not nested:
            counts[event.name] += 1
            times[event.name] += event.cpu_time_total
    return sum(counts.values()), counts, times


def profile_config(model_name: str, config_name: str, steps: int, workdir: str) -> dict[str, Any]:
    spec = MODELS[model_name]
    torch.manual_seed(0)
    plain = spec.build()
    monitored = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    opt_mon = torch.optim.AdamW(monitored.parameters(), lr=1e-3)
    monitor = attach("msmon", monitor_config(config_name, monitored), monitored, opt_mon, workdir)
    gen = torch.Generator().manual_seed(0)
    plain_s, mon_s = [], []
    for i in range(steps):
        batch = spec.batch_of(gen, torch.device("cpu"))
        for model, opt, bucket in ((plain, opt_plain, plain_s), (monitored, opt_mon, mon_s))[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            train_step(model, opt, batch)
            if i >= 2:
                bucket.append(time.perf_counter() - start)
    with CallCounter() as calls:  # one step each: the counters must not see each other
        train_step(monitored, opt_mon, spec.batch_of(gen, torch.device("cpu")))
    with BytesCounter() as read:
        train_step(monitored, opt_mon, spec.batch_of(gen, torch.device("cpu")))
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        train_step(monitored, opt_mon, spec.batch_of(gen, torch.device("cpu")))
    kernels, by_op, op_us = monitor_ops(prof)
    summary = monitor.summary()
    monitor.close()
    return {
        "model": model_name,
        "config": config_name,
        "plain_ms": 1e3 * statistics.median(plain_s),
        "monitored_ms": 1e3 * statistics.median(mon_s),
        "hook_calls": sum(calls.entries.values()),
        "hook_calls_by_function": dict(calls.entries.most_common()),
        "host_reads": dict(calls.host_reads),
        "kernels": kernels,
        "kernels_by_op": dict(by_op.most_common()),
        "kernel_us_by_op": {k: round(v) for k, v in op_us.most_common()},
        "stat_tensors": read.tensors,
        "stat_bytes": read.bytes,
        "repeats": read.repeats,
        "repeat_bytes": read.repeat_bytes,
        "monitor_summary": summary,
    }


def report(results: list[dict[str, Any]], bandwidth: float) -> str:
    lines = [
        f"Read bandwidth (sum over 512 MiB, {torch.get_num_threads()} threads): {bandwidth:.1f} GB/s",
        "",
        "| model | configuration | plain | monitored | difference | tensors read (repeats) | MB read "
        "(repeats) | floor (MB / bandwidth) | hook calls | host reads | kernels |",
        "|" + "---|" * 11,
    ]
    for r in results:
        floor_ms = r["stat_bytes"] / bandwidth / 1e6
        lines.append(
            f"| {r['model']} | {r['config']} | {r['plain_ms']:.1f} ms | {r['monitored_ms']:.1f} ms | "
            f"{r['monitored_ms'] - r['plain_ms']:+.1f} ms | {r['stat_tensors']} ({r['repeats']}) | "
            f"{r['stat_bytes'] / 1e6:.1f} ({r['repeat_bytes'] / 1e6:.1f}) | "
            f"{floor_ms:.2f} ms | {r['hook_calls']} | {sum(r['host_reads'].values())} | {r['kernels']} |"
        )
    for r in results:
        lines += [
            "",
            f"**{r['model']} / {r['config']}**: hook calls {r['hook_calls_by_function']}; "
            f"host reads {r['host_reads'] or 'none'}; kernel time by op (us, profiled): "
            + ", ".join(
                f"{op.removeprefix('aten::')} {r['kernels_by_op'][op]}x {us}"
                for op, us in list(r["kernel_us_by_op"].items())[:8]
            ),
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-3.7M")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=12, help="alternating timed steps per configuration")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="msmon-profile-") as workdir:
        for config in args.configs:
            results.append(profile_config(args.model, config, args.steps, os.path.join(workdir, config)))
    bandwidth = read_bandwidth_gbs()
    print(report(results, bandwidth))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"bandwidth_gbs": bandwidth, "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()

"""msmon's overhead benchmark: monitored vs unmonitored training steps, and against msprobe.

    python benchmarks/overhead.py                        # reference model, all configurations
    python benchmarks/overhead.py --models gpt-3.7M gpt-58M --compare-msprobe --json out.json
    python benchmarks/overhead.py --against 27a2ae3 --configs all_xy "wg+mv+param"   # make bench REV=27a2ae3

Each (tool, model, configuration) runs in its own process (bench_worker.py): two copies of
the model with the same weights, one monitored, stepped alternately on the same batches;
the overhead is the median of the per-pair step-time ratios, with the 10th-90th percentile
spread. Peak RSS comes from separate single-model processes (plain, and monitored per
configuration), taking turns round after round; each figure is the median of its rounds.
`--compare-msprobe` runs msprobe's TrainerMon the same way with the interpreter of a venv
where mindstudio-probe is installed (default /tmp/refvenv). `--against REV` times msmon at another
revision (checked out into a temporary git worktree, imported from there; the model, data and
config are this checkout's) beside this checkout's: per model and configuration, `--rounds` turns
each, alternating which goes first, `--pairs` / `--rounds` pairs a turn, each revision's ratios
pooled over its turns, so a regression shows in the same run, on the same machine state.
Machines shared with other work give noisy ratios: the table records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workloads import CONFIGS, MODELS  # noqa: E402

WORKER = os.path.join(HERE, "bench_worker.py")
ROOT = os.path.dirname(HERE)
DEFAULT_MSPROBE_PYTHON = "/tmp/refvenv/bin/python"


def run_worker(
    python: str, args: list[str], timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """Run one measurement; its last stdout line is the JSON result. `env`: variables set for it
    (PYTHONPATH: msmon imported from another checkout)."""
    try:
        environment = {**os.environ, **env} if env else None
        proc = subprocess.run([python, WORKER, *args], capture_output=True, text=True, timeout=timeout, env=environment)
    except subprocess.TimeoutExpired:
        print(f"  timed out: {' '.join(args)}", file=sys.stderr)
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"  failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def run_memories(jobs: list[tuple[str, str, list[str]]], timeout: float, runs: int) -> dict[str, Any]:
    """Peak RSS of `runs` fresh processes per job (key, interpreter, worker arguments): the
    median, and every run. A single run moves by a few MiB with the allocator's luck, as much as
    the difference being measured, and a batch of runs by a MiB with the machine's state, so the
    jobs take turns, round after round (plain, each configuration, plain, ...)."""
    values: dict[str, list[float]] = {key: [] for key, _, _ in jobs}
    first: dict[str, dict[str, Any]] = {}
    for _ in range(runs):
        for key, python, args in jobs:
            result = run_worker(python, args, timeout)
            if result is not None:
                first.setdefault(key, result)
                values[key].append(result["peak_rss_mib"])
    return {
        key: {**first[key], "peak_rss_mib": statistics.median(values[key]), "peak_rss_runs": values[key]}
        for key in first
    }


def msprobe_available(python: str) -> bool:
    if not os.path.exists(python):
        return False
    probe = subprocess.run([python, "-c", "import msprobe.pytorch, torch"], capture_output=True, timeout=120)
    return probe.returncode == 0


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        # msmon's statistics path, inherited by every worker: the native kernel when it is built
        # (the default) unless MSMON_NATIVE_STATS=0; each worker records what it used
        "native_stats": os.environ.get("MSMON_NATIVE_STATS", "") not in ("0", "false", "no", "off")
        and os.environ.get("MSMON_DEVICE_PATH", "").strip().lower() not in ("1", "true", "yes", "on"),
        # MSMON_DEVICE_PATH=1: the accelerators' code on the CPU (msmon.stats.device_path)
        "device_path": os.environ.get("MSMON_DEVICE_PATH", "").strip().lower() in ("1", "true", "yes", "on"),
    }


def fmt_ratio(r: dict[str, Any] | None) -> str:
    if not r:
        return "n/a"
    return f"×{r['ratio_median']:.3f} ({r['ratio_p10']:.2f}–{r['ratio_p90']:.2f})"


def fmt_mem(mon: dict[str, Any] | None, plain: dict[str, Any] | None) -> str:
    if not mon or not plain:
        return "n/a"
    delta = mon["peak_rss_mib"] - plain["peak_rss_mib"]
    return f"{delta:+.0f} MiB ({100 * delta / plain['peak_rss_mib']:+.1f} %)"


def self_reported(ours: dict[str, Any] | None, summary: dict[str, Any]) -> str:
    """The monitor's own clock as a share of the monitored step. Its summary's percentage is
    relative to the wall time between monitored steps, which here includes the plain copy's."""
    if not ours or summary.get("monitor_ms_per_step") is None:
        return "n/a"
    return f"{100 * summary['monitor_ms_per_step'] / ours['monitored_ms']:.1f} %"


def table(results: dict[str, Any], models: list[str], configs: list[str], compare: bool) -> str:
    head = ["model", "configuration", "plain step", "msmon", "msmon peak RSS", "msmon self-reported"]
    if compare:
        head += ["msprobe", "msprobe peak RSS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        plain_mem = results.get(f"memory/plain/{model}")
        for config in configs:
            ours = results.get(f"pairs/msmon/{model}/{config}")
            summary = (ours or {}).get("monitor_summary") or {}
            cells = [
                model,
                config,
                f"{ours['plain_ms']:.0f} ms" if ours else "n/a",
                fmt_ratio(ours),
                fmt_mem(results.get(f"memory/msmon/{model}/{config}"), plain_mem),
                self_reported(ours, summary),
            ]
            if compare:
                cells += [
                    fmt_ratio(results.get(f"pairs/msprobe/{model}/{config}")),
                    fmt_mem(results.get(f"memory/msprobe/{model}/{config}"), plain_mem),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread(ratios: list[float]) -> str:
    deciles = statistics.quantiles(ratios, n=10)
    return f"×{statistics.median(ratios):.3f} ({deciles[0]:.2f}–{deciles[-1]:.2f})"


def run_against(rev: str, args: argparse.Namespace, common: list[str]) -> dict[str, Any]:
    """This checkout and `rev` taking turns, per model and configuration (module docstring)."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = os.path.join(scratch, "rev")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", work, rev], check=True, capture_output=True)
        sides = [("this checkout", None), (rev, {"PYTHONPATH": os.path.join(work, "src")})]
        pairs = max(2, args.pairs // args.rounds)
        try:
            for model in args.models:
                for config in args.configs:
                    pooled: dict[str, list[float]] = {label: [] for label, _ in sides}
                    for turn in range(args.rounds):
                        for label, env in sides if turn % 2 == 0 else sides[::-1]:
                            print(f"{label:>14} {model} {config} turn {turn + 1}/{args.rounds} ...", file=sys.stderr)
                            base = ["--model", model, "--config", config, *common, "--pairs", str(pairs)]
                            result = run_worker(
                                sys.executable, [*base, "--warmup", str(args.warmup)], args.timeout, env
                            )
                            if result is not None:
                                pooled[label] += result["ratios"]
                    results[f"against/{model}/{config}"] = pooled
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", work], capture_output=True)
    lines = [f"| model | configuration | this checkout | {rev} |", "|---|---|---|---|"]
    for key, pooled in results.items():
        _, model, config = key.split("/", 2)
        cells = [spread(pooled[label]) if len(pooled[label]) > 1 else "n/a" for label, _ in sides]
        lines.append(f"| {model} | {config} | {cells[0]} | {cells[1]} |")
    print("\n".join(lines))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["gpt-3.7M"])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compare-msprobe", action="store_true", help="also run msprobe's TrainerMon")
    parser.add_argument(
        "--msprobe-python", default=DEFAULT_MSPROBE_PYTHON, help="interpreter of a venv with mindstudio-probe installed"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    parser.add_argument("--memory-runs", type=int, default=5, help="rounds of peak-RSS processes (median)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measurement")
    parser.add_argument("--json", help="write every result to this file")
    parser.add_argument("--against", metavar="REV", help="time msmon at REV too, taking turns with this checkout")
    parser.add_argument("--rounds", type=int, default=6, help="with --against: turns per revision")
    args = parser.parse_args()
    if args.against:
        common = ["--device", args.device] + (["--threads", str(args.threads)] if args.threads else [])
        load = os.getloadavg()[0]
        results = run_against(args.against, args, common)
        m = machine()
        where = f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}"
        print(f"\n{where}; load average {load:.2f} before; {args.pairs} pairs each")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"machine": m, **results}, fh, indent=2)
        return

    tools = [("msmon", sys.executable)]
    if args.compare_msprobe:
        if msprobe_available(args.msprobe_python):
            tools.append(("msprobe", args.msprobe_python))
        else:
            print(f"msprobe is not importable with {args.msprobe_python}; comparing skipped", file=sys.stderr)
    common = ["--device", args.device] + (["--threads", str(args.threads)] if args.threads else [])
    results: dict[str, Any] = {"machine": machine(), "load_before": os.getloadavg(), "started": time.time()}
    memory_jobs: list[tuple[str, str, list[str]]] = []
    for model in args.models:
        memory_jobs.append((f"memory/plain/{model}", sys.executable, ["--model", model, "--memory", "plain", *common]))
        for config in args.configs:
            for tool, python in tools:
                print(f"{tool:8s} {model:9s} {config} ...", file=sys.stderr, flush=True)
                base = ["--tool", tool, "--model", model, "--config", config, *common]
                load = os.getloadavg()[0]
                result = run_worker(
                    python, base + ["--pairs", str(args.pairs), "--warmup", str(args.warmup)], args.timeout
                )
                if result is not None:
                    result["load_before"], result["load_after"] = load, os.getloadavg()[0]
                results[f"pairs/{tool}/{model}/{config}"] = result
                memory_jobs.append((f"memory/{tool}/{model}/{config}", python, base + ["--memory", "monitored"]))
    if not args.no_memory:
        print(f"peak RSS: {args.memory_runs} rounds of {len(memory_jobs)} processes ...", file=sys.stderr, flush=True)
        results.update(run_memories(memory_jobs, args.timeout, args.memory_runs))
    results["load_after"] = os.getloadavg()
    compare = any(tool == "msprobe" for tool, _ in tools)
    text = table(results, args.models, args.configs, compare)
    print(text)
    m = results["machine"]
    print(
        f"\n{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['threads']} threads); load average "
        f"{results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after; {args.pairs} pairs each"
        + (
            "; msmon on the accelerator path (MSMON_DEVICE_PATH=1)."
            if m.get("device_path")
            else "."
            if m["native_stats"]
            else "; msmon with MSMON_NATIVE_STATS=0 (torch reductions)."
        )
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()

"""The CUDA table of issue 33: msmon against plain (and msprobe, in the same run) on a GPU.

    python benchmarks/gpu/accelerator_table.py               # on a CUDA machine: about 2-4 minutes
    python benchmarks/gpu/accelerator_table.py --dry-run     # here, on the CPU: the same code, a tiny model

For wg, wg+mv+param and 10-of-N-layers xy on the reference gpt model (benchmarks/workloads.py),
each configuration runs in its own process (benchmarks/bench_worker.py): a plain and a monitored
copy of the model stepped alternately on the same batches, the overhead the median of the
per-pair ratios. Each worker then runs one monitored step with synchronising calls raising
(`torch.cuda.set_sync_debug_mode("error")`, around forward/backward and around the whole step;
benchmarks/sync_check.py) and reports whether anything synchronised or a collector was switched
off. msprobe runs the same way where `import msprobe.pytorch` works with `--msprobe-python`
(default: this interpreter, then /tmp/refvenv); the device machines have no network, so
`pip install mindstudio-probe` may be impossible there: the table then says msprobe is absent.

msmon's accelerator path reduces with one compiled kernel per chunk (msmon.stats.fused_rows:
Inductor generates Triton code on CUDA, compiled at attach, cached on disk); `--both-routes`
also runs msmon with MSMON_COMPILED_STATS=0 (the `_foreach_*` route, which a device without a
compiler takes) as a column of its own.

`--dry-run` runs on the CPU with MSMON_DEVICE_PATH=1 (msmon takes the accelerator's code), the
tiny model and two pairs, with the CPU stand-in of the sync check (a host read asked by the
monitor raises): tests/unit/test_accelerator_table_dry_run.py runs it so that this script works
the day a GPU is lent.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from overhead import DEFAULT_MSPROBE_PYTHON, fmt_ratio, msprobe_available, run_worker  # noqa: E402

CONFIGS = ["wg", "wg+mv+param", "xy 10 of N"]


def sync_cell(result: dict[str, Any] | None) -> str:
    check = (result or {}).get("sync_check")
    if not check:
        return "n/a"
    bad = [scope for scope, r in check.items() if not r["ok"]]
    if not bad:
        return "no sync"
    first = check[bad[0]]
    why = first["error"] or f"switched off: {', '.join(first['collectors_switched_off'])}"
    return f"SYNC in {', '.join(bad)}: {why[:120]}"


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, MSMON_DEVICE_PATH=1 (the accelerator path)"


def msprobe_python(candidates: list[str]) -> str | None:
    for python in candidates:
        if python and msprobe_available(python):
            return python
    return None


@contextlib.contextmanager
def _route(tool: str) -> Iterator[None]:
    """MSMON_COMPILED_STATS=0 for the workers of the "msmon foreach" column."""
    saved = os.environ.get("MSMON_COMPILED_STATS")
    if tool == "msmon foreach":
        os.environ["MSMON_COMPILED_STATS"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MSMON_COMPILED_STATS", None)
        else:
            os.environ["MSMON_COMPILED_STATS"] = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, the tiny model, 2 pairs")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    parser.add_argument("--model", default=None, help="default: gpt-3.7M (gpt-tiny with --dry-run)")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--pairs", type=int, default=None, help="default: 30 (2 with --dry-run)")
    parser.add_argument("--warmup", type=int, default=None, help="default: 5 (1 with --dry-run)")
    parser.add_argument("--msprobe-python", default=None, help="an interpreter where msprobe imports")
    parser.add_argument("--no-msprobe", action="store_true")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per worker")
    parser.add_argument("--both-routes", action="store_true", help="also msmon's _foreach_* route")
    args = parser.parse_args(argv)
    dry = args.dry_run
    device = args.device or ("cpu" if dry else "cuda")
    model = args.model or ("gpt-tiny" if dry else "gpt-3.7M")
    pairs = args.pairs or (2 if dry else 30)
    warmup = args.warmup if args.warmup is not None else (1 if dry else 5)
    if device == "cpu":
        os.environ["MSMON_DEVICE_PATH"] = "1"  # inherited by the workers
    else:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here: run with --dry-run, or on a GPU machine", file=sys.stderr)
            return 2
    tools = [("msmon", sys.executable)]
    if args.both_routes:
        tools.append(("msmon foreach", sys.executable))
    probe = None
    if not args.no_msprobe:
        probe = msprobe_python([args.msprobe_python or "", sys.executable, DEFAULT_MSPROBE_PYTHON])
        if probe is not None:
            tools.append(("msprobe", probe))
    started = time.time()
    results: dict[tuple[str, str], dict[str, Any] | None] = {}
    for config in args.configs:
        for tool, python in tools:
            print(f"{tool} {model} {config} on {device} ...", file=sys.stderr, flush=True)
            worker = ["--tool", tool.split()[0], "--model", model, "--config", config, "--device", device]
            worker += ["--pairs", str(pairs), "--warmup", str(warmup), "--sync-check"]
            with _route(tool):
                results[(tool, config)] = run_worker(python, worker, args.timeout)
    head = ["configuration", "plain step", "msmon", "msmon sync check", "msprobe", "msprobe sync check"]
    if args.both_routes:
        head += ["msmon, _foreach_* route", "its sync check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config in args.configs:
        ours, theirs = results.get(("msmon", config)), results.get(("msprobe", config))
        absent = "absent" if probe is None else "n/a"
        cells = [
            config,
            f"{ours['plain_ms']:.1f} ms" if ours else "n/a",
            fmt_ratio(ours),
            sync_cell(ours),
            fmt_ratio(theirs) if probe is not None else absent,
            sync_cell(theirs) if probe is not None else absent,
        ]
        if args.both_routes:
            other = results.get(("msmon foreach", config))
            cells += [fmt_ratio(other), sync_cell(other)]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    identical = all(r["losses_identical"] for r in results.values() if r)
    print(
        f"\n{device_name(device)}; model {model}, {pairs} pairs after {warmup} warm-up; "
        f"losses bit-identical with and without msmon: {'yes' if identical else 'NO'}; "
        + ("msprobe: absent (mindstudio-probe not importable here)" if probe is None else f"msprobe from {probe}")
        + f"; {time.time() - started:.0f} s"
    )
    failed = [key for key, r in results.items() if r is None]
    synced = [key for key, r in results.items() if key[0].startswith("msmon") and r and sync_cell(r) != "no sync"]
    return 1 if failed or synced or not identical else 0


if __name__ == "__main__":
    sys.exit(main())

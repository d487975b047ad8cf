"""What the non-finite origin costs on the reference model: any alert rule switches it on
(`nan_origin` left unset), so a user who asked only for alerts pays for it.

    python benchmarks/nan_origin_cost.py                       # counts, then timed pairs (a quiet machine)
    python benchmarks/nan_origin_cost.py --counts-only         # the counts alone: any machine, any load
    python benchmarks/nan_origin_cost.py --pairs 60 --json out.json --device cuda

Two configurations of workloads.CONFIGS, the same but for the origin: "wg+alerts" (weight
gradients and the AnomalyNan rule: the origin on) and "wg+alerts-origin" (`"nan_origin": false`).

1. Counts of one steady-state step of the reference model (gpt-3.7M, one process, torch's
   AdamW), deterministic, so they hold on a loaded machine: the kernel-launching aten ops on
   the training thread on the accelerator path (MSMON_DEVICE_PATH=1, op_counts.py's counter),
   the host syncs among them (`_local_scalar_dense`: `.item()`, `bool(t)`), the tensor hooks
   registered (`Tensor.register_hook`) and the module hook calls the origin makes. What the
   origin costs is the difference of the two configurations; on an accelerator each op is a
   kernel launch plus its Python dispatch (5-20 µs of host time each).
2. Timed pairs (overhead.py's worker: a monitored and a plain copy of the model stepped
   alternately in one process): the step-time ratio of each configuration to a plain run. Only
   meaningful on a quiet machine; the table records the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_counts import KernelOps, _output_dir, accelerator_path  # noqa: E402
from overhead import fmt_ratio, machine, run_worker  # noqa: E402
from workloads import MODELS, monitor_config, train_step  # noqa: E402

MODEL = "gpt-3.7M"
ON, OFF = "wg+alerts", "wg+alerts-origin"
SYNC_OPS = ("_local_scalar_dense",)
WARMUP_STEPS = 3


def count_step(config: str | None, model_name: str = MODEL) -> dict[str, Any]:
    """One steady-state step of the model, monitored with `config` (a workloads.CONFIGS name) or
    plain: kernel ops, host syncs, tensor hooks registered, module hook calls of the origin."""
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cpu")
    monitor = None
    with contextlib.ExitStack() as stack:
        if config is not None:
            from msmon import TrainerMon

            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="msmon-origin-cost-"))
            path = os.path.join(workdir, "monitor.json")
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(monitor_config(config, model), fh)
            stack.enter_context(_output_dir(os.path.join(workdir, "out")))
            monitor = TrainerMon(path, params_have_main_grad=False)
            monitor.set_monitor(model, optimizer)
        for _ in range(WARMUP_STEPS):
            train_step(model, optimizer, spec.batch_of(gen, device))
        batch = spec.batch_of(gen, device)
        registered = [0]
        original = torch.Tensor.register_hook

        def counting(tensor: torch.Tensor, hook: Any) -> Any:
            registered[0] += 1
            return original(tensor, hook)

        torch.Tensor.register_hook = counting  # type: ignore[method-assign]
        try:
            with KernelOps() as ops:
                train_step(model, optimizer, batch)
        finally:
            torch.Tensor.register_hook = original  # type: ignore[method-assign]
        origin = _origin_work(monitor)
        if monitor is not None:
            monitor.close()
    return {
        "ops": ops.count,
        "host_syncs": sum(ops.by_name.get(name, 0) for name in SYNC_OPS),
        "tensor_hooks": registered[0],
        "origin": origin,
        "by_name": dict(sorted(ops.by_name.items())),
    }


def _origin_work(monitor: Any) -> dict[str, int] | None:
    """The origin collector's own count of the step just run (collectors/nan_origin/first_step.py)."""
    if monitor is None:
        return None
    for collector in monitor.runner.built.collectors:
        work = getattr(collector, "last_work", None)
        if work is not None and collector.__class__.__name__ == "NanOriginCollector":
            return dict(vars(work))
    return None


def counts() -> dict[str, Any]:
    with accelerator_path():
        plain, on, off = count_step(None), count_step(ON), count_step(OFF)
    added = {name: on["by_name"].get(name, 0) - off["by_name"].get(name, 0) for name in on["by_name"]}
    return {
        "plain": {k: plain[k] for k in ("ops", "host_syncs", "tensor_hooks")},
        ON: on,
        OFF: off,
        "origin_adds": {
            "ops": on["ops"] - off["ops"],
            "host_syncs": on["host_syncs"] - off["host_syncs"],
            "tensor_hooks": on["tensor_hooks"] - off["tensor_hooks"],
            "by_name": {name: n for name, n in sorted(added.items()) if n},
        },
    }


def timed(pairs: int, warmup: int, device: str, threads: int | None, timeout: float) -> dict[str, Any]:
    results = {}
    for config in (ON, OFF):
        args = ["--tool", "msmon", "--model", MODEL, "--config", config, "--pairs", str(pairs)]
        args += ["--warmup", str(warmup), "--device", device] + (["--threads", str(threads)] if threads else [])
        results[config] = run_worker(sys.executable, args, timeout)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts-only", action="store_true", help="no timing: the counts hold on any machine")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", help="write every result to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or 1)
    result: dict[str, Any] = {"model": MODEL, "counts": counts()}
    adds = result["counts"]["origin_adds"]
    on = result["counts"][ON]
    print(
        f"{MODEL}, one step on the accelerator path: the origin adds {adds['ops']} kernel ops "
        f"({on['origin']['reductions']} reductions), {adds['tensor_hooks']} tensor hooks, "
        f"{on['origin']['module_hooks']} module hook calls and {adds['host_syncs']} host syncs "
        f"(the monitor without it: {result['counts'][OFF]['ops'] - result['counts']['plain']['ops']} ops)",
        flush=True,
    )
    if not args.counts_only:
        result["machine"] = {**machine(), "load_average": os.getloadavg()}
        result["pairs"] = timed(args.pairs, args.warmup, args.device, args.threads, args.timeout)
        for config, ratio in result["pairs"].items():
            print(f"{config:18s} step time against a plain run: {fmt_ratio(ratio)}", flush=True)
        print(f"load average: {result['machine'].get('load_average')}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

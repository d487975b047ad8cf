"""Cost of one call of the native statistics kernel: the ctypes loader against the old pybind one.

The kernel's loop is the same in both (the C-ABI core is the former extension without its torch
binding), so what differs is the per-call work on the Python side: checking the tensors,
passing their pointers, allocating the result. Each side is timed as msmon.stats calls it:
formerly native.eligible() on every tensor, then the pybind function; now native.readable_rows(),
which checks while it packs the call. Measured on the reference model's tensors
(gpt-3.7M), msprobe's six ops:

- `1 x 1 element`, `50 x 1 element`: overhead alone (nothing to read);
- `batch of all parameters`: the weight-gradient path, one call for the model;
- `each parameter alone`: tensor_stats' path (flat row), summed over the parameters.

Both kernels run interleaved, block by block; the medians are per call (per pass over the
parameters for the last case), in microseconds of the calling thread's CPU time (one
thread reads), which other processes on a shared machine do not inflate the way they do
wall time. The rows of both are compared bit for bit.

    python benchmarks/native_call_cost.py --pybind ~/.cache/torch_extensions/py311_cpu/<name>/<name>.so

`--pybind` is a build of the former fused_stats.cpp (git show 43c9d45:src/msmon/native/fused_stats.cpp)
with torch.utils.cpp_extension; without it only the ctypes kernel is measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import MODELS  # noqa: E402

COLUMNS = [0, 1, 2, 3, 4, 5]  # msprobe's six ops: norm min max mean zeros nans
PER_ELEMENT = [False, False, False, True, True, False]


def load_pybind(path: str) -> Callable[..., torch.Tensor]:
    """The former path of msmon.stats._native_rows: native.eligible on every tensor, then the
    pybind call."""
    from msmon.stats.native import eligible

    name = os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows_of = module.stats_rows

    def old_path(ts: list[torch.Tensor], *args: Any) -> torch.Tensor | None:
        if not all(eligible(t) for t in ts):
            return None
        return rows_of(ts, *args)

    return old_path


def cases(model: torch.nn.Module) -> dict[str, tuple[list[list[torch.Tensor]], bool]]:
    """name -> (the calls of one repetition, each a list of tensors; flat). The model's gradients."""
    params = [p.grad for p in model.parameters()]
    return {
        "1 x 1 element": ([[torch.ones(1)]], True),
        "50 x 1 element": ([[torch.ones(1) for _ in range(50)]], False),
        f"batch of all {len(params)} parameters": ([params], False),
        f"each of the {len(params)} parameters alone": ([[p] for p in params], True),
    }


def time_block(rows_of: Callable[..., torch.Tensor], calls: list[list[torch.Tensor]], flat: bool, reps: int) -> float:
    start = time.thread_time_ns()  # CPU time: robust to other work on a shared machine
    for _ in range(reps):
        for ts in calls:
            rows_of(ts, 1e-8, COLUMNS, PER_ELEMENT, flat, 1, 1 << 22)
    return (time.thread_time_ns() - start) / reps / 1e3


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pybind", help="a build of the former torch-extension kernel (.so)")
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MSMON_NATIVE_STATS", "1")
    from msmon.stats import native

    kernels: dict[str, Callable[..., torch.Tensor]] = {}
    start = time.perf_counter()
    if native.load() is None:
        sys.exit("the native statistics could not be built")
    first_use_s = time.perf_counter() - start
    kernels["ctypes"] = native.readable_rows()  # msmon.stats._native_rows' path now
    if args.pybind:
        kernels["pybind"] = load_pybind(args.pybind)
    torch.manual_seed(0)
    model = MODELS["gpt-3.7M"].build()
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # gradients' values, not the init's zeros and ones
    results: dict[str, Any] = {}
    for name, (calls, flat) in cases(model).items():
        want = [kernels["ctypes"](ts, 1e-8, COLUMNS, PER_ELEMENT, flat, 1, 1 << 22) for ts in calls]
        same = all(
            torch.equal(k(ts, 1e-8, COLUMNS, PER_ELEMENT, flat, 1, 1 << 22).view(torch.int64), w.view(torch.int64))
            for k in kernels.values()
            for ts, w in zip(calls, want)
        )
        reps = max(1, int(2000 / max(1, sum(t.numel() for ts in calls for t in ts) // 10000 + len(calls))))
        samples: dict[str, list[float]] = {k: [] for k in kernels}
        for _ in range(args.blocks):
            for label, rows_of in kernels.items():
                samples[label].append(time_block(rows_of, calls, flat, reps))
        results[name] = {
            "bit_identical": same,
            "calls_per_rep": len(calls),
            "reps_per_block": reps,
            **{f"{label}_median_us": statistics.median(v) for label, v in samples.items()},
        }
        print(
            f"{name:38s} "
            + "  ".join(f"{label} {statistics.median(v):8.2f} us" for label, v in samples.items())
            + f"  bit-identical: {same}"
        )
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "isa": native.isa(),
        "kernel": native.built_path(),
        "first_use_s": first_use_s,
        "compiled_here": native.compiled_here,
        "results": results,
    }
    print(json.dumps({k: v for k, v in record.items() if k != "results"}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=2)


if __name__ == "__main__":
    main()

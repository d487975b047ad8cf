"""Writer-thread cost of the TensorBoard sink per step, msprobe's layout against by_rank's.

by_rank adds the summary lanes (per category and op, the maximum over the category's tensors,
and a text table naming each holder), computed on the writer thread from the host table. Both
sinks write the same steps, interleaved block by block, into their own directory; the medians
are the writing thread's CPU time per step (process CPU time is what a shared machine does not
inflate), over a synthetic step shaped like `make demo`'s rank 0: about 4,600 rows in 10
categories, msprobe's seven ops.

    .venv/bin/python benchmarks/tensorboard_layout_cost.py --steps 40 --rows 4600
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from msmon.output.sinks.tensorboard_sink import TensorBoardSink
from msmon.records.rows import RowKey, StepRecord

CATEGORIES = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated")
CATEGORIES += ("exp_avg", "exp_avg_sq", "update", "ratio")
OPS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]


def records(rows: int, steps: int) -> list[StepRecord]:
    """Steps of the same rows, each with its own list of the same RowKey objects, as the writer gets them."""
    keys = [RowKey(CATEGORIES[i % len(CATEGORIES)], f"layers.{i // 40}.m{i % 40}.weight") for i in range(rows)]
    gen = torch.Generator().manual_seed(0)
    return [
        StepRecord(step, 0, OPS, list(keys), table=torch.rand(rows, len(OPS), generator=gen, dtype=torch.float64))
        for step in range(steps)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=4600)
    parser.add_argument("--block", type=int, default=5, help="steps per sink before switching to the other")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = records(args.rows, args.steps)
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        sinks = {"msprobe": TensorBoardSink(a), "by_rank": TensorBoardSink(b, by_rank=True)}
        times: dict[str, list[float]] = {name: [] for name in sinks}
        for start in range(0, args.steps, args.block):
            for name, sink in sinks.items():
                for record in steps[start : start + args.block]:
                    t0 = time.thread_time()
                    sink.write(record)
                    times[name].append(time.thread_time() - t0)
        for sink in sinks.values():
            sink.close()
    result = {
        name: {"median_ms_per_step": round(statistics.median(t) * 1e3, 3), "steps": len(t)} for name, t in times.items()
    }
    result["rows"], result["ops"] = args.rows, len(OPS)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

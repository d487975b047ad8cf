"""The bundled example's training loop (examples/train_tiny_gpt.py: DDP, 2 micro-batches per step),
timed: what `benchmarks/demo_cost.py` runs with and without `msmon run`.

Each rank prints one JSON line at the end: the median wall time of its steps after the warm-up,
and the garbage collector's work over those same steps (time in collections, their number per
generation), counted with `gc.callbacks` — collections stop the training thread wherever they
happen, and the objects a monitor keeps through a step are what makes them frequent and long.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from tiny_gpt import TinyGPT, lm_loss, synthetic_batch  # noqa: E402


class GcClock:
    """Time in garbage collections and their count per generation, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self.longest = 0.0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self.on:
            spent = time.perf_counter() - self._started
            self.seconds += spent
            self.longest = max(self.longest, spent)
            self.collections[info["generation"]] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--grad-acc", type=int, default=2)
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model = TinyGPT()
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    clock = GcClock()
    times = []
    for step in range(args.steps):
        clock.on = step >= args.warmup
        started = time.perf_counter()
        for _ in range(args.grad_acc):
            loss = lm_loss(model, synthetic_batch(gen)) / args.grad_acc
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    clock.on = False
    timed = times[args.warmup :]
    result = {
        "rank": rank,
        "steps": len(timed),
        "step_ms": 1000 * statistics.median(timed),
        "mean_step_ms": 1000 * statistics.mean(timed),
        "gc_ms_per_step": 1000 * clock.seconds / len(timed),
        "gc_collections": clock.collections,
        "gc_longest_ms": 1000 * clock.longest,
        "loss": float(loss.detach()),
    }
    print("TIMED " + json.dumps(result), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

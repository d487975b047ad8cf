"""What a config-agreement round costs the training thread (msmon/agreement.py).

Run with 2 ranks: `python -m torch.distributed.run --standalone --nproc-per-node 2
benchmarks/agreement_rounds.py [--steps N]`. Each step does a little work and one framework-like
all_reduce; then, by mode: nothing; a round on a step that records nothing (a one-number
all_gather started asynchronously, the previous round read); a round carried by the shard
gather (the numbers are already there); a synchronous one-number all_gather read at once, for
comparison. Prints, on rank 0, microseconds per step spent in the round (median of the modes'
interleaved repetitions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from msmon.runtime.agreement import ConfigAgreement


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.group.WORLD
    work = torch.randn(128, 128)

    def run(mode: str) -> float:
        agreement = ConfigAgreement([world], rank)
        spent = 0.0
        dist.barrier()
        for _ in range(args.steps):
            y = work @ work
            dist.all_reduce(y[:4].contiguous())  # the framework's own collective of the step
            started = time.perf_counter()
            if mode == "round, nothing recorded":
                agreement.end_round({})
                agreement.decide()
            elif mode == "round, carried by the shard gather":
                agreement.end_round({id(world): torch.zeros(dist.get_world_size())})
                agreement.decide()
            elif mode == "synchronous all_gather (comparison)":
                mine = torch.zeros(1, dtype=torch.float64)
                parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, mine)
                torch.cat(parts).tolist()
            spent += time.perf_counter() - started
        return 1e6 * spent / args.steps

    modes = [
        "nothing",
        "round, nothing recorded",
        "round, carried by the shard gather",
        "synchronous all_gather (comparison)",
    ]
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            times[mode].append(run(mode))
    if rank == 0:
        print(json.dumps({m: round(statistics.median(t), 1) for m, t in times.items()}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A DDP training script whose rank output meets a full disk.

`--full-rank R --full-at S`: before step S, rank R points the CSV file that step writes at
/dev/full (a real write failing with ENOSPC), as a disk that fills up mid-run would. The
script knows only msmon's output layout (MONITOR_OUTPUT_DIR/<...>-rank<r>-<uid>/); with no
monitor it just trains. `--steps N` with no --full-rank: the run a tiny disk fills by itself.
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
import torch.distributed as dist


def fill_disk_at(rank: int, step: int) -> None:
    base = os.environ.get("MONITOR_OUTPUT_DIR")
    for directory in glob.glob(os.path.join(base, f"*-rank{rank}-*")) if base else []:
        os.symlink("/dev/full", os.path.join(directory, f"grad_reduced_{step}-{step}.csv"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--full-rank", type=int)
    parser.add_argument("--full-at", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        if step == args.full_at and rank == args.full_rank:
            fill_disk_at(rank, step)
        loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"rank {rank} step {step} loss {loss.item():.8f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

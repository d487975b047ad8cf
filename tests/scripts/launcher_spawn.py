"""Two training ranks without torchrun, the ways scripts start them themselves, with no
monitoring code: `--how spawn` calls torch.multiprocessing.spawn (the parent builds nothing),
`--how slurm` is one of srun's tasks (rank and world size from SLURM_PROCID and SLURM_NTASKS).

The srun task builds its model and optimizer before torch.distributed starts, so a monitor
attached at construction must take the rank from SLURM_PROCID. Both train the same small MLP
(seed 0) with DDP on gloo for 3 steps, 2 micro-batches each.

The ranks meet through a file in `--rendezvous` (a directory), named for the job (the spawning
process's id; srun's SLURM_JOB_ID), so that a job run again never finds a previous attempt's
file; not through a TCP port: a port the test found free and rank 0 binds seconds later can be
taken in between (by any process's outgoing connection), and then rank 0 fails to bind it and
rank 1 connects to whoever holds it, waiting for an answer until gloo's timeout.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import MLP  # noqa: E402


def train(rank: int, world: int, rendezvous: str, optimizer_first: bool) -> None:
    init = f"file://{rendezvous}"
    if not optimizer_first:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if optimizer_first:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        for _ in range(2):
            ddp(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {rank} trained 3 steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=["spawn", "slurm"], required=True)
    parser.add_argument("--rendezvous", required=True, help="a directory for the ranks' rendezvous file")
    args = parser.parse_args()
    if args.how == "spawn":
        store = os.path.join(args.rendezvous, f"spawn-{os.getpid()}")
        mp.spawn(train, args=(2, store, False), nprocs=2, join=True)
    else:
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        store = os.path.join(args.rendezvous, f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}")
        train(rank, world, store, optimizer_first=True)


if __name__ == "__main__":
    main()

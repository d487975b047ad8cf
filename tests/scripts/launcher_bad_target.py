"""A plain DDP training script: `msmon run` with a target naming no module of its model must
stop every rank before the first optimizer step (the script prints a line after each one)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Linear(8, 16))
    model.add_module("layers", torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)))
    model.add_module("head", torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    print(f"rank {rank} model built", flush=True)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for step in range(3):
        ddp(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {rank} step {step} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

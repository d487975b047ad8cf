"""An unmodified 2-rank gloo training script (no msmon code) whose collectives go through a
library that imported `all_reduce` before the script ran; for `msmon run` tests."""

import argparse

import comm_cached_lib  # copies torch.distributed.all_reduce at import time
import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        model(torch.randn(3, 4)).square().mean().backward()
        for param in model.parameters():
            comm_cached_lib.average(param.grad, world)
        metric = torch.tensor([float(rank + step)])
        dist.all_reduce(metric)  # site:direct
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

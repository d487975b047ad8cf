"""A script whose last act is a collective it never waits for: after a few DDP steps on gloo,
each rank starts many all_gathers with `async_op=True` and returns at once.

They complete on gloo's worker threads while the interpreter shuts down, which is what
makes a rank abort in teardown ("terminate called without an active exception") under plain
torchrun; `msmon run` must end it cleanly (src/msmon/system/exit_drain.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

GATHERS = 200


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).square().mean().backward()
        optimizer.step()
    for size in range(GATHERS):  # never waited for: they end one after another while the script exits
        payload = torch.full((1 << 12 + size % 8,), float(dist.get_rank()))
        parts = [torch.empty_like(payload) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, payload, async_op=True)
    print(f"rank {dist.get_rank()} left {GATHERS} all_gathers in flight", flush=True)


if __name__ == "__main__":
    main()

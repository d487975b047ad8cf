"""An unmodified DDP script (2 ranks on gloo) training the attention model of tests/l2_models.py;
each rank writes its losses to `<argv[1]>/rank<r>.txt`, so runs with and without monitoring
can be compared."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from l2_models import AttentionLM  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(AttentionLM(order="b,s,h,d"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(3):
        for _ in range(2):
            idx = torch.randint(0, 40, (2, 12), generator=gen)
            loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()) / 2
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(repr(loss.item() * 2))
    with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as fh:
        fh.write("\n".join(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

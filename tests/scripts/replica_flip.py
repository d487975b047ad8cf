"""A DDP training script (gloo, CPU) with no monitoring code, for `msmon run`: a small MLP with
dropout, gradient clipping and AdamW, and an optional single flipped bit on one rank.

--flip-step k --flip-rank r: at the start of step k, before its forward, rank r flips bit
--flip-bit of element --flip-index of --flip-param, under torch.no_grad through an int32 view,
as silent data corruption would. With --flip-grad the bit is flipped in that parameter's
reduced gradient instead, after backward and before the optimizer step. Each rank saves its
weights at the end (`weights_rank{r}.pt` in --out), the truth the test compares the
monitor's verdict with.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.drop(self.fc1(x))))


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    with torch.no_grad():
        word = t.view(-1).view(torch.int32)
        word[index] ^= (1 << bit) if bit < 31 else -(1 << 31)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--flip-step", type=int, default=-1)
    parser.add_argument("--flip-rank", type=int, default=0)
    parser.add_argument("--flip-param", default="fc1.weight")
    parser.add_argument("--flip-index", type=int, default=3)
    parser.add_argument("--flip-bit", type=int, default=20)
    parser.add_argument("--flip-grad", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # each rank its own init (DDP broadcasts rank 0's) and dropout masks
    model = torch.nn.parallel.DistributedDataParallel(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    target = dict(model.module.named_parameters())[args.flip_param]
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        if step == args.flip_step and rank == args.flip_rank and not args.flip_grad:
            flip_bit(target, args.flip_index, args.flip_bit)
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if step == args.flip_step and rank == args.flip_rank and args.flip_grad:
            flip_bit(target.grad, args.flip_index, args.flip_bit)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save(
        {n: p.detach().clone() for n, p in model.module.named_parameters()},
        os.path.join(args.out, f"weights_rank{rank}.pt"),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

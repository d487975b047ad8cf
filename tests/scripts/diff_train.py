"""An ordinary training script for `msmon diff`'s end-to-end tests (no monitoring code): an MLP
on synthetic data, DDP when torchrun starts several ranks, plain otherwise.

The global batch of a step is `ranks x --grad-acc` micro-batches, micro-batch g made from the
seed (step, g); rank r takes micro-batches r*acc .. r*acc + acc - 1. A 2-rank run with
--grad-acc 2 and a single-process run with --grad-acc 4 train on the same global batch.

--perturb-from K: from step K on, fc2 multiplies its output by 1 + 1e-4 inside its own forward
(a small numerics change in one layer). --lr-scale: the learning rate times this.
--threads: torch's intra-op threads (a reduction over more than 32k elements, such as the
gradient clipping's norm of fc2.weight, splits by thread count: the stored values of reruns
with different thread counts are not bit for bit the same).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

IN, HIDDEN, OUT, BATCH = 32, 256, 16, 160


class PerturbedLinear(torch.nn.Linear):
    """A Linear whose output is multiplied by `factor` (1.0: left alone) in its own forward."""

    factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * self.factor if self.factor != 1.0 else out


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.act = torch.nn.Tanh()
        self.fc2 = PerturbedLinear(HIDDEN, HIDDEN)
        self.act2 = torch.nn.Tanh()
        self.fc3 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act2(self.fc2(self.act(self.norm(self.fc1(x))))))


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + index)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grad-acc", type=int, default=1)
    parser.add_argument("--perturb-from", type=int)
    parser.add_argument("--lr-scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    if distributed:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    trained: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2 * args.lr_scale)
    for step in range(args.steps):
        if args.perturb_from is not None and step >= args.perturb_from:
            model.fc2.factor = 1.0 + 1e-4
        for micro in range(args.grad_acc):
            x, y = micro_batch(step, rank * args.grad_acc + micro)
            last = micro == args.grad_acc - 1
            with trained.no_sync() if distributed and not last else torch.enable_grad():  # type: ignore[operator]
                loss = (trained(x) - y).square().mean() / args.grad_acc
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

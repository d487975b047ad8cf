"""Train the tiny GPT on synthetic data: an ordinary script with no monitoring code in it.

python examples/train_tiny_gpt.py --steps 20
torchrun --nproc-per-node 2 examples/train_tiny_gpt.py      # DDP on gloo
msmon run --config examples/monitor.json --nproc-per-node 2 -- examples/train_tiny_gpt.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import TinyGPT, lm_loss, synthetic_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grad-acc", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(args.seed)
    model = TinyGPT()
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + rank)

    for step in range(args.steps):
        for _ in range(args.grad_acc):
            loss = lm_loss(model, synthetic_batch(gen)) / args.grad_acc
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item() * args.grad_acc:.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

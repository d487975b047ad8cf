"""An ordinary DDP training script (a tiny GPT on synthetic data) with no monitoring code.

`--api CONFIG` makes the script call the TrainerMon API itself, right after building the
model and the optimizer: the output `msmon run` gives for the unmodified script is compared
with that.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from tiny_gpt import TinyGPT, lm_loss, synthetic_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-acc", type=int, default=2)
    parser.add_argument("--api", help="monitor config: attach with the TrainerMon API")
    parser.add_argument("--api-first", action="store_true", help="build the TrainerMon before the optimizer")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    monitor = None
    if args.api and args.api_first:  # msprobe's own examples build it first, attach later
        from msmon import TrainerMon

        monitor = TrainerMon(args.api)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(vocab=64, d_model=16, n_layer=2, n_head=2, seq_len=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if args.api:
        from msmon import TrainerMon

        (monitor or TrainerMon(args.api)).set_monitor(model, optimizer)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        for _ in range(args.grad_acc):
            loss = lm_loss(model, synthetic_batch(gen, batch=4, seq_len=8, vocab=64)) / args.grad_acc
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"rank {rank} step {step} loss {loss.item() * args.grad_acc:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

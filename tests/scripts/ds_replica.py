"""A DeepSpeed training script with no monitoring code, for `msmon run`: the tests' MLP on CPU
ranks (gloo), fp32, ZeRO stage from the command line, and an optional single flipped bit in one
weight element on one rank at the start of a step (before its forward), through an int32 view.
Each rank saves its model parameters at the end (`weights_rank{r}.pt` in --out).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import deepspeed  # noqa: E402

from conftest import MLP  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--flip-step", type=int, default=-1)
    parser.add_argument("--flip-rank", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MLP()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        if step == args.flip_step and rank == args.flip_rank:
            with torch.no_grad():
                model.fc2.weight.view(-1).view(torch.int32)[5] ^= 1 << 18
        loss = engine(torch.randn(2, 8, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    torch.save(
        {n: p.detach().clone() for n, p in model.named_parameters()}, os.path.join(args.out, f"weights_rank{rank}.pt")
    )


if __name__ == "__main__":
    main()

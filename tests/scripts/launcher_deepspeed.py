"""A DeepSpeed script for the `deepspeed` launcher, with no monitoring code: it takes the
launcher's `--local_rank`, starts torch.distributed on gloo and trains the small MLP (seed 0)
with ZeRO stage 0 (fp32 AdamW) for 3 steps of 2 micro-batches."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import deepspeed  # noqa: E402

from conftest import MLP  # noqa: E402

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 10_000,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MLP()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3 * CONFIG["gradient_accumulation_steps"]):
        loss = engine(torch.randn(4, 8, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    print(f"rank {rank} trained 3 steps", flush=True)


if __name__ == "__main__":
    main()

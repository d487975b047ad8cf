"""A DeepSpeed training script (ZeRO from the command line, fp32, 2 CPU ranks on gloo) with no
monitoring code, for `msmon run` with a skip_step action: at --spike-step every rank's targets
are multiplied by 1e3 (a loss spike). After every step each rank prints `rank R step S <sha256>`
of the full fp32 weights DeepSpeed itself assembles (`safe_get_full_fp32_param`, a collective
under ZeRO) and of the Adam moments it keeps, the truth the test compares."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

from conftest import MLP  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--spike-step", type=int, default=5)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MLP()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10_000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(4, 8, generator=gen)
        target = x[:, :4] * (1e3 if step == args.spike_step else 1.0)
        loss = (engine(x) - target).pow(2).mean()
        engine.backward(loss)
        engine.step()
        digest = hashlib.sha256()
        for p in model.parameters():
            for tensor in (
                safe_get_full_fp32_param(p),
                safe_get_full_optimizer_state(p, "exp_avg"),
                safe_get_full_optimizer_state(p, "exp_avg_sq"),
            ):
                digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
        print(f"rank {rank} step {step} {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()

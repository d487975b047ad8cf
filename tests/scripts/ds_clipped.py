"""A DeepSpeed training script with `gradient_clipping: 1.0` and no monitoring code, for `msmon run`:
a tiny MLP on 2 CPU ranks (gloo), ZeRO stage and dtype from the command line.

DeepSpeed clips (and, under fp16, unscales) inside its optimizer's `step()`, then steps the torch
AdamW it wraps (`optimizer.optimizer`) once per parameter group. As the independent truth, this
script registers its own step pre-hook on that inner AdamW (consumed_grads.py): the norm, sum and
largest magnitude of the gradients it consumes in an engine step (the flat fp32 partitions under
ZeRO, over the data-parallel ranks; the whole fp32 copies under stage 0, each rank's own).
DeepSpeed's own pre-clipping norm is kept beside them, to show that clipping took effect.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import deepspeed  # noqa: E402
from consumed_grads import ConsumedGradients  # noqa: E402

from conftest import MLP  # noqa: E402

LOSS_SCALE = 50.0  # a loss this large has gradients of norm well above the clipping threshold of 1


def ds_config(stage: int, dtype: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10_000,
    }
    if dtype == "bf16":  # stage 0: FP16_UnfusedOptimizer; stage 1 (fp32 accumulation): BF16_Optimizer
        config["bf16"] = {"enabled": True}
        if stage == 1:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    # two parameter groups, as scripts without weight decay on biases have: ZeRO-1/2 step the inner
    # AdamW once per group, ZeRO-3 once per sub-group
    groups = [
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0},
    ]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, config=ds_config(args.stage, args.dtype)
    )
    inner = getattr(optimizer, "optimizer", optimizer)  # stage 0 fp32: the AdamW is the engine's optimizer
    partitioned = type(optimizer).__name__ in (
        "DeepSpeedZeroOptimizer",
        "DeepSpeedZeroOptimizer_Stage3",
        "BF16_Optimizer",
    )
    consumed = ConsumedGradients(inner, partitioned)
    truth = {
        "optimizer": type(optimizer).__name__,
        "numel": {name: p.ds_numel if hasattr(p, "ds_numel") else p.numel() for name, p in model.named_parameters()},
        "steps": [],
    }
    gen = torch.Generator().manual_seed(100 + rank)
    while len(truth["steps"]) < args.steps:
        x = torch.randn(2, 8, generator=gen)
        out = engine(x.to(torch.bfloat16) if args.dtype == "bf16" else x)
        engine.backward(out.float().pow(2).mean() * LOSS_SCALE)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and inner is optimizer:  # stage 0 fp32: the engine clips `.grad` in step() and keeps no norm
            unclipped = float(sum(p.grad.double().pow(2).sum() for p in model.parameters()) ** 0.5)
        engine.step()
        if boundary:
            step = ConsumedGradients.take([consumed])
            norm = engine.get_global_grad_norm()
            step["unclipped_norm"] = float(norm) if norm is not None else unclipped
            truth["steps"].append(step)
    with open(os.path.join(args.out, f"truth_rank{rank}.json"), "w") as fh:
        json.dump(truth, fh)


if __name__ == "__main__":
    main()

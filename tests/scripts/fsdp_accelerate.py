"""An ordinary `accelerate` training loop under FSDP2: model and optimizer built before
`accelerator.prepare`, which shards the model and points the optimizer at the sharded
parameters. No monitoring code. Saves the losses and the whole weights after each step.

accelerate 1.16 turns FSDP on only for multi-accelerator distributed types (its
AcceleratorState never leaves MULTI_CPU on CPU: ACCELERATE_USE_FSDP and an fsdp_plugin are
silently ignored and DDP is used), so on CPU this script sets the state's distributed type to
FSDP itself, after which `prepare` runs accelerate's own FSDP2 path unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType, set_seed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import reference_stats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type = DistributedType.FSDP  # what a GPU run gets from the plugin
    accelerator.state.fsdp_plugin = plugin
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.Tanh(), torch.nn.Linear(15, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    gen = torch.Generator().manual_seed(100 + accelerator.process_index)
    losses, weights = [], []
    for _ in range(3):
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        weights.append({n: reference_stats(p.full_tensor()) for n, p in model.named_parameters()})
    with open(os.path.join(args.out, f"truth_rank{accelerator.process_index}.json"), "w") as fh:
        json.dump({"losses": losses, "param_updated": weights, "model": type(model).__name__}, fh)
    accelerator.end_training()


if __name__ == "__main__":
    main()

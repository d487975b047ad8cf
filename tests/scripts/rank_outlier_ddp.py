"""A DDP training script (gloo, CPU) with no monitoring code, for `msmon run`: a small MLP with
dropout, gradient clipping and AdamW; every rank draws its own batches, and one rank's batches
can be corrupted from some step on.

--bad-rank r --bad-step k --scale c: from step k on, rank r's inputs are multiplied by c (no
NaN, the loss stays finite), as a broken data shard or a wrong normalisation would.
--nan-rank r --nan-step k --nan-module m: at step k, the script's own forward hook makes one
element of module m's output NaN on rank r alone (a flaky kernel or device); the other ranks meet
it only through the gradient all-reduce.
--nan-batch-step k: at step k every rank's batch holds a NaN (the same bad batch everywhere).
Each rank saves what it computed (`truth_rank{r}.json` in --out): per step its loss and the norm of its
input batch, the truth the test compares the monitor's verdict with.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bad-rank", type=int, default=-1)
    parser.add_argument("--bad-step", type=int, default=-1)
    parser.add_argument("--scale", type=float, default=30.0)
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--nan-module", default="fc1")
    parser.add_argument("--nan-batch-step", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # each rank its own init (DDP broadcasts rank 0's) and dropout masks
    net = Net()
    at = {"step": -1}

    def make_nan(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if rank != args.nan_rank or at["step"] != args.nan_step:
            return None
        output = output.clone()
        output.view(-1)[0] = float("nan")
        return output

    net.get_submodule(args.nan_module).register_forward_hook(make_nan)  # before msmon attaches: it sees the NaN
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    truth: dict[str, list[float]] = {"loss": [], "input_norm": []}
    for step in range(args.steps):
        at["step"] = step
        x = torch.randn(16, 8, generator=gen)
        y = x[:, :4].clone()
        if rank == args.bad_rank and step >= args.bad_step:
            x = x * args.scale
        if step == args.nan_batch_step:
            x[0, 0] = float("nan")
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        truth["loss"].append(loss.item())
        truth["input_norm"].append(x.norm().item())
    with open(os.path.join(args.out, f"truth_rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(truth, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

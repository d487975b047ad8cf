"""A 2-rank training script (gloo, CPU) with no msmon code, for the tracker formats and msprobe V2:
a small MLP, each rank on its own batches, gradients averaged with an all_reduce of its own (as
data parallelism does), Adam.

--wandb-run: rank 0 makes its own W&B run ("script-run", project "script") and logs its loss at
its own step (`step=`), as scripts do (--step-seconds: a step as long as a real one, so that
msmon's lanes of a step reach the run while the script still logs); --mlflow-run: rank 0 starts its own MLflow run
("script-run") and logs its loss. Both finish their run at the end, as scripts do.
--v2 CONFIG: monitor with msprobe's own TrainerMonitorV2 (mindstudio-probe), not msmon.
--nan-rank R --nan-step S: rank R's batch of step S holds a NaN (a bad batch); where the averaged
gradients are not finite the script zeroes them before the optimizer step (so that the weights
stay finite), as a loss scaler keeps a bad step out of the weights.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--wandb-run", action="store_true")
    parser.add_argument("--mlflow-run", action="store_true")
    parser.add_argument("--v2", help="an msprobe V2 config: monitor with msprobe's TrainerMonitorV2")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="how long a step takes at least")
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-step", type=int, default=-1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights on every rank
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = None
    if args.v2:
        from msprobe.core.monitor_v2 import TrainerMonitorV2

        monitor = TrainerMonitorV2(args.v2)
        monitor.start(model=model, optimizer=optimizer)
    run = None
    if rank == 0 and args.wandb_run:
        import wandb

        run = wandb.init(project="script", name="script-run")
    if rank == 0 and args.mlflow_run:
        import mlflow

        mlflow.start_run(run_name="script-run")
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for step in range(args.steps):
        x = torch.randn(6, 8, generator=gen)
        target = x[:, :4].clone()
        if (rank, step) == (args.nan_rank, args.nan_step):
            x[0, 0] = float("nan")
        loss = (model(x) - target).square().mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
            torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_seconds)
        if run is not None:
            run.log({"loss": loss.item()}, step=step)
        if rank == 0 and args.mlflow_run:
            mlflow.log_metric("loss", loss.item(), step=step)
    if monitor is not None:
        monitor.stop()
    if run is not None:
        run.finish()
    if rank == 0 and args.mlflow_run:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Two DDP ranks that a healthy script trains in ways msmon once got wrong, each writing its
own truth. Two ways to start them:

- `torchrun --nproc-per-node 2 uneven_ddp.py OUT torchrun CONFIG`: each rank trains twice, with
  the script's own TrainerMon on CONFIG (`alert.on_nan: "stop"`), then plainly: the plain run's
  weights are what every monitored run must end with;
- `msmon run --no-torchrun -- python uneven_ddp.py OUT fork`: the ranks are forked by
  torch.multiprocessing.start_processes(start_method="fork") from a parent that imported torch
  (and msmon's bootstrap) and builds nothing; msmon attaches by itself. Each rank iterates a
  DataLoader with a worker process before it builds its optimizer (the worker is forked from a
  process that is no rank yet); the dataset builds an optimizer in the worker, which must never
  be monitored.

What every run does:
- DDP with find_unused_parameters=True: the `extra` layer is used on rank 0 only, so rank 1's
  local gradient of it is zero and DDP's reduction still writes the average into its `.grad`.
- A GradScaler whose first scaled losses overflow (to inf, forced here: the loss is multiplied
  by inf in the first OVERFLOWS iterations): their optimizer steps are skipped (GradScaler.step
  does not call optimizer.step), as in the first steps of fp16 training.
- Rank 1's loss is multiplied by 0 in one step: its local gradient is exactly zero, all finite.
- Uneven inputs inside DDP's join(): rank 0 runs EXTRA more iterations than rank 1, whose
  collectives DDP's join hook shadows.

Truth, per optimizer step that was taken (skipped iterations are told by the scale falling):
the loss of each rank; the rank-local gradient (the sum of autograd.grad of an unwrapped copy
of the model, taken before DDP reduces); and, while both ranks train, the reduced gradient
recomputed from both ranks' local gradients gathered with torch.distributed (mean over the
world, DDP's average), so that cos and |local|/|reduced| do not take DDP's word for it. After
rank 1 joined, rank 0's reduced gradient is DDP's `.grad` (rank 1 contributes zeros). The final
weights are saved too. Files: OUT/{monitored,plain,forked}_rank{r}.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ITERATIONS, EXTRA, ZERO_LOSS_STEP = 7, 2, 1
OVERFLOWS = 2  # the first iterations' scaled losses are inf: their optimizer steps are skipped


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.extra = torch.nn.Linear(16, 16)  # used on rank 0 only
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc2(h)


class OptimizerInWorker(torch.utils.data.Dataset):
    """Builds an optimizer inside the DataLoader worker: a worker is never a training rank."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        return torch.full((2,), float(index))


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def train(rank: int, world: int, config: str | None = None) -> dict:
    """The job on this rank, with a TrainerMon on `config` when given: its truth."""
    torch.manual_seed(0)
    model, reference = Net(), Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = None
    if config is not None:  # imported here: the forked job's parent imports torch and nothing of msmon
        from msmon import TrainerMon

        mon = TrainerMon(config)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    if mon is not None:
        mon.set_monitor(ddp, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000)
    use_extra = rank == 0
    gen = torch.Generator().manual_seed(100 + rank)
    iterations = ITERATIONS + (EXTRA if rank == 0 else 0)
    names = [n for n, _ in model.named_parameters()]
    truth: dict = {"skipped": 0, "steps": {}}
    step = 0
    with ddp.join():
        for iteration in range(iterations):
            reference.load_state_dict(model.state_dict())
            x = torch.randn(4, 8, generator=gen) * 4
            factor = 0.0 if rank == 1 and step == ZERO_LOSS_STEP else 1.0
            if iteration < OVERFLOWS:
                factor = float("inf")
            loss = ddp(x, use_extra).square().mean() * factor
            scaler.scale(loss).backward()
            grads = torch.autograd.grad(
                reference(x, use_extra).square().mean() * factor, list(reference.parameters()), allow_unused=True
            )
            local = [torch.zeros_like(p) if g is None else g for p, g in zip(reference.parameters(), grads)]
            scale = scaler.get_scale()
            scaler.unscale_(optimizer)
            both = iteration < ITERATIONS
            if both:  # the reduced gradient from both ranks' local ones, gathered
                parts = [torch.empty(sum(t.numel() for t in local), dtype=torch.float64) for _ in range(world)]
                dist.all_gather(parts, flat(local))
                reduced = torch.stack(parts).mean(0)
            else:  # rank 1 has joined: DDP's reduction averages rank 0's gradient with zeros
                reduced = flat(p.grad for p in model.parameters())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if scaler.get_scale() < scale:  # the step was skipped (inf/NaN in the scaled gradients)
                truth["skipped"] += 1
                continue
            mine = flat(local)
            local_norm, reduced_norm = mine.norm(), reduced.norm()
            cos = float(mine @ reduced / (local_norm * reduced_norm)) if local_norm > 0 else float("nan")
            truth["steps"][step] = {
                "loss": loss.item(),
                "cos": cos,
                "norm_ratio": float(local_norm / reduced_norm),
                "local_norms": {n: float(g.double().norm()) for n, g in zip(names, local)},
                "scale": scale,  # what backward ran on: the rows of the local gradients are scaled
                "both": both,
            }
            step += 1
    if mon is not None:
        mon.close()
    truth["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    print(f"rank {rank}: {step} steps, {truth['skipped']} skipped", flush=True)
    return truth


def forked_rank(rank: int, world: int, out: str, rendezvous: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    for _ in torch.utils.data.DataLoader(OptimizerInWorker(), num_workers=1):
        pass
    torch.save(train(rank, world), os.path.join(out, f"forked_rank{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    out, how = sys.argv[1], sys.argv[2]
    if how == "fork":  # the ranks meet through a file named for this job, never through a port
        store = os.path.join(out, f"rendezvous-{os.getpid()}")
        mp.start_processes(forked_rank, args=(2, out, store), nprocs=2, join=True, start_method="fork")
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(train(rank, world, sys.argv[3]), os.path.join(out, f"monitored_rank{rank}.pt"))
    torch.save(train(rank, world), os.path.join(out, f"plain_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

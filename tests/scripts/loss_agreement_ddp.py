"""DDP on gloo under TrainerMon with loss_distribution and grad_agreement, the script writing its
own truth: every loss it computed (per step and micro-batch) and the gradient agreement it
computes itself.

Each step runs `acc` micro-batches, all but the last under `no_sync()` (or, with `every` in
argv, each one all-reduced by DDP), through a GradScaler (on CPU; `scaler` in argv) or plainly;
with `infer` in argv the monitor is not told grad_acc_steps (it infers it in step 0).
Alongside, an unwrapped copy of the model (loaded from
the DDP model's weights at the start of every step) runs the same micro-batches through
torch.autograd.grad: their sum is the rank-local gradient; the DDP model's `.grad`, unscaled
by the scaler, is the all-reduced one. cos and |local|/|reduced| of their concatenations, in float64,
are the truth for the agreement rows. Rank 1's inputs are scaled by 3 from step `skew_step` on,
so its gradient departs from the average.

The same job runs again with no monitor: its losses and final weights are saved beside, to be
bit-identical with the monitored run's.

argv: config, out dir, acc, steps, skew_step, [scaler] [every] [infer]. Run with torchrun --nproc-per-node 2.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import MLP  # noqa: E402
from msmon import TrainerMon  # noqa: E402


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def train(
    config: str | None, acc: int, steps: int, skew_step: int, use_scaler: bool, every: bool = False, infer: bool = False
) -> dict:
    """The job, monitored with `config` or (None) plainly: the script's losses, its own
    agreement and the final weights."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    reference = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMon(config) if config is not None else None
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if mon is not None:
        mon.set_monitor(ddp, optimizer, **({} if infer else {"grad_acc_steps": acc}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, enabled=use_scaler)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, agreement = {}, {}
    for step in range(steps):
        reference.load_state_dict(model.state_dict())
        local_sum = [torch.zeros_like(p) for p in reference.parameters()]
        for micro in range(acc):
            x = torch.randn(4, 8, generator=gen) * (3.0 if rank == 1 and step >= skew_step else 1.0)
            sync = contextlib.nullcontext() if micro == acc - 1 or every else ddp.no_sync()
            with sync:
                loss = ddp(x).square().mean()
                scaler.scale(loss).backward()
            losses[(step, micro)] = loss.detach().clone()
            # torch.autograd.grad, not backward: the script's only backward calls are the DDP model's
            grads = torch.autograd.grad(reference(x).square().mean(), list(reference.parameters()))
            local_sum = [a + g for a, g in zip(local_sum, grads)]
        scaler.unscale_(optimizer)
        local = flat(local_sum)
        reduced = flat(p.grad for p in model.parameters())
        agreement[step] = (
            float(local @ reduced / (local.norm() * reduced.norm())),
            float(local.norm() / reduced.norm()),
        )
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    if mon is not None:
        mon.close()
    return {"losses": losses, "agreement": agreement, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def main() -> None:
    config, out, acc, steps, skew_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    use_scaler, every, infer = ("scaler" in sys.argv[6:], "every" in sys.argv[6:], "infer" in sys.argv[6:])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    monitored = train(config, acc, steps, skew_step, use_scaler, every, infer)
    plain = train(None, acc, steps, skew_step, use_scaler, every)  # the same job with no monitor: the losses to match
    monitored["plain"] = plain
    torch.save(monitored, os.path.join(out, f"truth_rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

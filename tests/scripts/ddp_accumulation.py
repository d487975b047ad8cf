"""DDP on gloo with gradient accumulation, with or without `no_sync()`, under TrainerMon.

Alongside, an unwrapped copy of the model (loaded from the DDP model's weights at the start of
every step) runs plain autograd on the same micro-batches: its `.grad` after each micro-batch is
the rank-local gradient accumulated so far, the independent truth for `grad_unreduced`; the DDP
model's `.grad` at step time is the truth for `grad_reduced`. Both are saved per rank, with the
most gradient copies the monitor held at once.

argv: config, out dir, mode (`sync`: every micro-batch all-reduced; `no_sync`: only the last;
`manual`: all under no_sync, the script all-reducing `.grad` in place after all but the last),
micro-batches per step, steps, [nan_step: rank 1 makes its loss NaN in micro-batch 0 of that
step], then flags: `bucket_view` (DDP's gradient_as_bucket_view), `infer` (grad_acc_steps not
given), `inner` (the monitor attached to the bare model before DDP wraps it), `keep_grads`
(`zero_grad(set_to_none=False)`: `.grad` stays the same tensor, zeroed in place, every step).
Run with torchrun --nproc-per-node 2.
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import MLP  # noqa: E402
from msmon import TrainerMon  # noqa: E402
from msmon.collectors.grads.collector import GradCollector  # noqa: E402

NAN_RANK = 1


def main() -> None:
    config, out, mode, acc, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    nan_step = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    flags = set(sys.argv[7:])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    reference = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = TrainerMon(config)
    acc_given = None if "infer" in flags else acc
    if "inner" in flags:  # attached to the bare model before the script wraps it, as `msmon run` may be
        mon.set_monitor(model, optimizer, grad_acc_steps=acc_given)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view="bucket_view" in flags)
    if "inner" not in flags:
        mon.set_monitor(ddp, optimizer, grad_acc_steps=acc_given)
    grads = next(c for c in mon.collectors if isinstance(c, GradCollector))
    gen = torch.Generator().manual_seed(100 + rank)
    truth, copies = [], 0
    for step in range(steps):
        reference.load_state_dict(model.state_dict())
        micro_truth = []
        for micro in range(acc):
            x = torch.randn(4, 8, generator=gen)
            poisoned = rank == NAN_RANK and step == nan_step and micro == 0
            scale = float("nan") if poisoned else 1.0
            last = micro == acc - 1
            quiet = (mode == "no_sync" and not last) or mode == "manual"
            with ddp.no_sync() if quiet else contextlib.nullcontext():
                (ddp(x).square().mean() * scale).backward()
            if mode == "manual" and not last:  # the script averages the gradients itself, in place
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(dist.get_world_size())
            copies = max(copies, len(grads.local))  # rank-local sums the monitor kept apart
            (reference(x).square().mean() * scale).backward()
            micro_truth.append({n: p.grad.detach().clone() for n, p in reference.named_parameters()})
        reduced = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        truth.append({"micro": micro_truth, "reduced": reduced})
        reference.zero_grad(set_to_none=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none="keep_grads" not in flags)
    mon.close()
    torch.save({"steps": truth, "copies": copies}, os.path.join(out, f"truth_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

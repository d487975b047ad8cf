"""DDP on gloo with the TrainerMon API: records rank-local and reduced gradients, and saves the
gradients an unwrapped copy of the model computes on the same data (the independent truth)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import MLP  # noqa: E402
from msmon import TrainerMon  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = MLP()
reference = MLP()
reference.load_state_dict(model.state_dict())
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.0)
mon = TrainerMon(sys.argv[1])
mon.set_monitor(ddp, optimizer, grad_acc_steps=2)
gen = torch.Generator().manual_seed(100 + rank)
truth = []
for step in range(2):
    batches = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    with ddp.no_sync():
        ddp(batches[0]).sum().backward()
    ddp(batches[1]).sum().backward()
    for x in batches:
        reference(x).sum().backward()
    local = {n: p.grad.clone() for n, p in reference.named_parameters()}
    reduced = {n: p.grad.clone() for n, p in model.named_parameters()}
    truth.append({"local": local, "reduced": reduced})
    reference.zero_grad()
    optimizer.step()
    optimizer.zero_grad()
mon.close()
torch.save(truth, os.path.join(sys.argv[2], f"truth_rank{rank}.pt"))
dist.destroy_process_group()

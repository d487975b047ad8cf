"""Two gloo ranks attach a monitor at the same moment on an empty kernel cache (MSMON_NATIVE_STATS
unset): each writes what it did (compiled, loaded) and whether the kernel's rows of its own
gradients match the torch reductions'."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import MLP  # noqa: E402
from msmon import TrainerMon  # noqa: E402
from msmon.stats import native  # noqa: E402
from msmon.stats.engine import tensor_stats  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = MLP()
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
mon = TrainerMon(sys.argv[1])
dist.barrier()  # both attach (and so look for the kernel) together
mon.set_monitor(ddp, optimizer)
gen = torch.Generator().manual_seed(100 + rank)
for step in range(2):
    ddp(torch.randn(4, 8, generator=gen)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
ddp(torch.randn(4, 8, generator=gen)).square().mean().backward()
ops = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
grads = [p.grad for p in model.parameters()]
with_kernel = [tensor_stats(g, ops, 1e-8).tolist() for g in grads]
kernel = native._loaded
native._loaded = None  # the torch reductions, for the comparison
native._tried = True
with_torch = [tensor_stats(g, ops, 1e-8).tolist() for g in grads]
native._loaded = kernel
mon.close()
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as fh:
    json.dump(
        {
            "compiled": native.compiled_here,
            "isa": native.isa(),
            "path": native.built_path(),
            "with_kernel": with_kernel,
            "with_torch": with_torch,
        },
        fh,
    )
dist.destroy_process_group()

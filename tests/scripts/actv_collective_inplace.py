"""Two gloo ranks on the accelerator path (MSMON_DEVICE_PATH=1): the script's own collectives
write into hooked tensors in place, as Megatron's tensor-parallel regions do (a collective moves
no version counter): in forward, fc1's output is all-reduced after its hook; in backward, the
gradient of fc2's input is all-reduced in place after its hook (a copy-to-region Function).
Saves every rank's tensors computed by plain torch, the independent truth."""

import os
import sys

import torch
import torch.distributed as dist

from msmon import TrainerMon


class CopyToRegion(torch.autograd.Function):
    """Megatron's _CopyToModelParallelRegion: identity forward, in-place all-reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad)
        return grad


class Parallel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.fc1(x)
        with torch.no_grad():
            dist.all_reduce(h)  # the reduce-from region: in place, after fc1's hook
        return self.fc2(CopyToRegion.apply(h))


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = Parallel()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
mon = TrainerMon(sys.argv[1])
mon.set_monitor(model, optimizer, grad_acc_steps=1)
xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + r)) for r in range(2)]
for _ in range(2):
    model(xs[rank]).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
mon.close()

# the truth by plain torch, every rank's part computed here (same weights, lr=0)
hs = [model.fc1(x).detach() for x in xs]
summed = (hs[0] + hs[1]).requires_grad_(True)
grads = []
for r in range(2):
    (g,) = torch.autograd.grad(model.fc2(summed).square().mean(), summed)
    grads.append(g)
truth = {
    "actv": {"fc1.output": hs[rank], "fc2.input": summed.detach()},
    "actv_grad": {"fc2.input": grads[rank], "fc1.output": grads[0] + grads[1]},
}
torch.save(truth, os.path.join(sys.argv[2], f"truth_rank{rank}.pt"))
dist.destroy_process_group()

"""Two ranks (DDP on gloo) train a small MLP stack under TrainerMon; at step 5, micro-step 1,
rank 1's own forward hook makes one element of `blocks.1.fc2`'s output inf (the fault is the
script's, not the monitor's). Rank 0 only meets the damage later, through the gradient
all-reduce. Run with torchrun --nproc-per-node 2; argv: config path, steps.
"""

import contextlib
import sys

import torch
import torch.distributed as dist

from msmon import TrainerMon

INJECT_STEP, INJECT_MICRO, INJECT_RANK, INJECT_MODULE = 5, 1, 1, "blocks.1.fc2"


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Stack(torch.nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    config, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Stack()
    where = {"step": -1, "micro": -1}

    def inject_inf(module, args, output):
        if rank == INJECT_RANK and (where["step"], where["micro"]) == (INJECT_STEP, INJECT_MICRO):
            output = output.clone()
            output.view(-1)[3] = float("inf")
            return output
        return None

    # registered before the monitor attaches, so the monitor's hooks see the faulty output
    model.get_submodule(INJECT_MODULE).register_forward_hook(inject_inf)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    mon = TrainerMon(config)
    mon.set_monitor(ddp, optimizer, grad_acc_steps=2)
    gen = torch.Generator().manual_seed(10 + rank)
    for step in range(steps):
        where["step"] = step
        for micro in range(2):
            where["micro"] = micro
            x = torch.randn(8, 16, generator=gen)
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean() / 2
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mon.close()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

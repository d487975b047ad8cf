"""An unmodified DDP script (a small MLP stack on gloo) in which, at step INJECT_STEP, rank 1's
own forward hook makes one element of `blocks.1.fc2`'s output inf; rank 0 meets the damage only
through the gradient all-reduce. Each rank prints a line after every optimizer step it
finishes, so a test sees where each rank stopped. No monitoring code: run it under `msmon run`.
argv: steps.
"""

import sys

import torch
import torch.distributed as dist

INJECT_STEP, INJECT_RANK, INJECT_MODULE = 3, 1, "blocks.1.fc2"


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
    steps = int(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Stack()
    current = {"step": -1}

    def inject_inf(module, args, output):
        if rank == INJECT_RANK and current["step"] == INJECT_STEP:
            output = output.clone()
            output.view(-1)[3] = float("inf")
            return output
        return None

    model.get_submodule(INJECT_MODULE).register_forward_hook(inject_inf)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(10 + rank)
    for step in range(steps):
        current["step"] = step
        x = torch.randn(8, 16, generator=gen)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"rank {rank} finished step {step}", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()

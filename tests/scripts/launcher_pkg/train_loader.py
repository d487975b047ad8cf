"""DDP training fed by a DataLoader with two worker processes per rank, started with
"spawn" (fresh interpreters that run the job's sitecustomize again). No monitoring code;
each DataLoader worker leaves its pid in $LAUNCHER_TEST_PIDS, so a test can tell which
processes were workers."""

import os

import torch
import torch.distributed as dist


def note_worker(_worker_id: int) -> None:
    directory = os.environ.get("LAUNCHER_TEST_PIDS")
    if directory:
        open(os.path.join(directory, f"loader-{os.getpid()}"), "w").close()


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(12, 8, generator=gen), torch.randn(12, 4, generator=gen))
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, num_workers=2, multiprocessing_context="spawn", worker_init_fn=note_worker
    )
    steps = 0
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    print(f"rank {dist.get_rank()} trained {steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

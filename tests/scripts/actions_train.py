"""An unmodified DDP script (a small MLP on gloo, CPU, AdamW) with faults to order, for the
alert.actions tests. No monitoring code: run it under `msmon run`, or plain torchrun for the
reference. Each rank prints `rank R finished step S` after every optimizer step, and with
--hashes DIR writes, after every step, a line `S <sha256 of its weights' bytes>` to
DIR/rank{R}.txt (the bit-exact record two runs are compared by).

--bad-rank R --bad-step S --bad-scale X: rank R's batch of step S is multiplied by X (one rank's
batches go bad). --spike-step S: every rank's targets of step S are multiplied by 1e3 (a loss
spike). --flip-rank R --flip-step S: at the start of step S rank R flips one bit of fc1.weight
(a replica fault). --kill-rank R --kill-step S: after step S's backward, rank R waits a second
(the others reach the monitor's vote at the end of the step meanwhile) and kills itself
(SIGKILL); with --hang it sleeps --hang-seconds instead, then exits.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def weights_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hashes")
    parser.add_argument("--bad-rank", type=int, default=-1)
    parser.add_argument("--bad-step", type=int, default=-1)
    parser.add_argument("--bad-scale", type=float, default=1e3)
    parser.add_argument("--spike-step", type=int, default=-1)
    parser.add_argument("--flip-rank", type=int, default=-1)
    parser.add_argument("--flip-step", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--hang-seconds", type=float, default=30.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    hashes = open(os.path.join(args.hashes, f"rank{rank}.txt"), "w") if args.hashes else None  # noqa: SIM115
    for step in range(args.steps):
        if step == args.flip_step and rank == args.flip_rank:
            with torch.no_grad():
                model.module.fc1.weight.view(-1).view(torch.int32)[3] ^= 1 << 20
        x = torch.randn(16, 8, generator=gen)
        target = x[:, :4].clone()
        if step == args.bad_step and rank == args.bad_rank:
            x = x * args.bad_scale
        if step == args.spike_step:
            target = target * 1e3
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        if step == args.kill_step and rank == args.kill_rank:
            print(f"rank {rank} leaves at step {step} at {time.time():.3f}", flush=True)
            time.sleep(1.0)
            if args.hang:
                time.sleep(args.hang_seconds)
                os._exit(0)
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if hashes is not None:
            hashes.write(f"{step} {weights_hash(model.module)}\n")
            hashes.flush()
        print(f"rank {rank} finished step {step}", flush=True)
    print(f"rank {rank} done at {time.time():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A tiny 2-rank gloo training job that runs the collectives msmon watches.

Each rank saves, per step, clones of what every collective call had before and after it
(keyed by the `# site:` marker on the call's line), the losses and the final weights, so the
tests can compute the expected statistics independently. Run it with torchrun, with or
without a monitor config (`--config`), optionally breaking one rank's monitor (`--fail-rank`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

from msmon import TrainerMon


class Capture:
    """What each call site handled in one step: {site: {"pre": [...], "post": [...]}}."""

    def __init__(self) -> None:
        self.sites: dict[str, dict[str, list]] = defaultdict(lambda: {"pre": [], "post": []})

    def add(self, site: str, pre: list[torch.Tensor], post: list[torch.Tensor]) -> None:
        self.sites[site]["pre"].extend(t.detach().clone().tolist() for t in pre)
        self.sites[site]["post"].extend(t.detach().clone().tolist() for t in post)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = 1 - rank
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.config:
        monitor = TrainerMon(args.config, params_have_main_grad=False)
        monitor.set_monitor(model, optimizer)
        if rank == args.fail_rank:
            monitor.ctx.step_ops = ["no_such_op"]  # this rank's statistics fail inside a collective hook
    data = torch.Generator().manual_seed(100 + rank)
    captured, losses = [], []
    for step in range(args.steps):
        log = Capture()
        loss = model(torch.randn(3, 4, generator=data)).square().mean()
        loss.backward()
        losses.append(loss.item())
        for param in model.parameters():  # two calls from one line, combined in one row
            before = param.grad.clone()
            dist.all_reduce(param.grad)  # site:grads
            log.add("grads", [before], [param.grad])
            param.grad /= world

        shard = torch.arange(6.0).reshape(2, 3) + rank + step
        if step == 1 and rank == 1:
            shard[0, 0] = float("nan")  # a NaN that arrives on rank 0 through communication
        gathered = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(gathered, shard)  # site:gather
        log.add("gather", [shard], gathered)

        pieces = [torch.full((3,), float(10 * rank + i + step)) for i in range(world)]
        reduced = torch.empty(3)
        dist.reduce_scatter(reduced, pieces)  # site:scatter
        log.add("scatter", pieces, [reduced])

        announced = torch.randn(5, generator=data) if rank == 0 else torch.zeros(5)
        before = announced.clone()
        dist.broadcast(announced, src=0)  # site:bcast
        log.add("bcast", [before], [announced])

        outgoing = torch.linspace(0, 1, 4) * (rank + 1) + step
        incoming = torch.empty(4)
        sent = dist.isend(outgoing, peer)  # site:isend
        received = dist.irecv(incoming, peer)  # site:irecv
        received.wait()
        sent.wait()
        log.add("isend", [outgoing], [outgoing])
        log.add("irecv", [], [incoming])

        mine, theirs = torch.full((2,), rank + 0.5), torch.empty(2)
        ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
        works = dist.batch_isend_irecv(ops)  # site:batch
        for work in works:
            work.wait()
        log.add("batch", [mine], [mine, theirs])

        pending = torch.ones(2, 2) * (rank + 1) * (step + 1)
        before = pending.clone()
        work = dist.all_reduce(pending, async_op=True)  # site:async
        work.wait()
        log.add("async", [before], [pending])

        optimizer.step()
        optimizer.zero_grad()
        captured.append(log.sites)
        print(f"rank {rank} finished step {step}", flush=True)

    weights = [p.detach().tolist() for p in model.parameters()]
    with open(os.path.join(args.out, f"captured_rank{rank}.json"), "w") as fh:
        json.dump({"steps": captured, "losses": losses, "weights": weights}, fh)
    if args.config:
        monitor.close()  # what the monitor would write at exit, written now (os._exit below skips atexit)
    dist.destroy_process_group()
    # torch 2.13's gloo sometimes aborts in the interpreter's teardown after this job's collectives
    # ("terminate called without an active exception", about one run in four, with or without
    # msmon imported): everything is written by now, so leave without running that teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

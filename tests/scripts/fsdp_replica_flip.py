"""An HSDP / FSDP training script (gloo, CPU) with no monitoring code, for `msmon run`: a small
MLP with dropout, gradient clipping and AdamW, sharded by FSDP2 (`fully_shard`) on a 2-D
(replicate, shard) mesh (`--mode hsdp`), a 1-D mesh (`fsdp2`), or by FSDP1 with HYBRID_SHARD
(`fsdp1-hybrid`) or NO_SHARD (`fsdp1-noshard`), and an optional single flipped bit on one rank.

--flip-step k --flip-rank r: at the start of step k, before its forward, rank r flips bit
--flip-bit of element --flip-index of its own local piece of --flip-param (`to_local()` of the
DTensor; FSDP1's original parameter, a view of its flat shard), under torch.no_grad through an
int32 view, as silent data corruption would. Each rank saves its local pieces at the end
(`pieces_rank{r}.pt` in --out), the truth the test compares the monitor's verdict with.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from replica_flip import Net, flip_bit  # the same model and bit flip as the DDP test (this folder)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def shard(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    if mode in ("hsdp", "fsdp2"):
        from torch.distributed.fsdp import fully_shard

        shape = (2, world // 2) if mode == "hsdp" else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
        for module in (model.fc1, model.fc2, model):
            fully_shard(module, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    hybrid = mode == "fsdp1-hybrid"
    return FSDP(
        model,
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.NO_SHARD,
        device_mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hybrid else None,
        device_id=torch.device("cpu"),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["hsdp", "fsdp2", "fsdp1-hybrid", "fsdp1-noshard"], default="hsdp")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--flip-step", type=int, default=-1)
    parser.add_argument("--flip-rank", type=int, default=0)
    parser.add_argument("--flip-param", default="fc1.weight")
    parser.add_argument("--flip-index", type=int, default=3)
    parser.add_argument("--flip-bit", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)  # the same init on every rank (FSDP shards it; it does not broadcast)
    model = shard(Net(), args.mode)
    named = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(200 + rank)  # each rank its own dropout masks
    for step in range(args.steps):
        if step == args.flip_step and rank == args.flip_rank:
            flip_bit(local(named[args.flip_param]), args.flip_index, args.flip_bit)
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        loss.backward()
        if hasattr(model, "clip_grad_norm_"):  # FSDP1: the norm over all shards, as FSDP computes it
            model.clip_grad_norm_(0.5)
        else:  # FSDP2: DTensor gradients, the whole norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.save(
        {n: local(p).detach().clone() for n, p in named.items()}, os.path.join(args.out, f"pieces_rank{rank}.pt")
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

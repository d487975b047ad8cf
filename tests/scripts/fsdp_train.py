"""An FSDP training script with no monitoring code, for `msmon run`: a small model with uneven
shapes on 2 CPU ranks (gloo), sharded by FSDP2 (`fully_shard`, also as HSDP) or FSDP1
(`FullyShardedDataParallel`, `use_orig_params` True or False; `fsdp1-noshard`: NO_SHARD with
original parameters), trained by torch.optim.Adam.

It saves, in the same run, the whole tensors as torch itself assembles them, as the truth:
`full_tensor()` of the DTensor weights, gradients and moments (FSDP2);
`summon_full_params(with_grads=True)` and the moments' pieces all-gathered (FSDP1 with
original parameters); `summon_full_params` and FSDP's own `optim_state_dict` (flat parameters,
whose reduced gradient is the ranks' mean of an unwrapped copy's gradients, by `all_reduce`);
and the rank-local gradients that copy computes on this rank's last micro-batch. Also, per step,
the gradient agreement by plain torch: cos and norm ratio of that copy's summed gradients
against their mean over the ranks (`all_reduce`), in float64.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import reference_stats  # noqa: E402

BETAS, EPS, LR = (0.9, 0.999), 1e-8, 1e-2


class Uneven(torch.nn.Module):
    """Dimension 0 of every weight is odd, so its two shards differ in size; `scale` has one
    row, so rank 1 holds an empty piece of it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 15)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(15, 3)
        self.scale = torch.nn.Parameter(torch.ones(1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))) * self.scale


def stats(t: torch.Tensor) -> dict:
    return reference_stats(t.detach().double())


def update_ratio(m: torch.Tensor, v: torch.Tensor, t: float) -> tuple[dict, dict]:
    m_hat = m.double() / (1 - BETAS[0] ** t)
    root_v = (v.double() / (1 - BETAS[1] ** t)).sqrt()
    ratio = torch.where(root_v > 0, m_hat / root_v, torch.zeros_like(m_hat))
    return stats(m_hat / (root_v + EPS)), stats(ratio)


def mg_share(g: torch.Tensor, m: torch.Tensor) -> float:
    return float((torch.sign(g.double()) == torch.sign(m.double())).double().mean())


class Fsdp2:
    def __init__(self, model: torch.nn.Module, hybrid: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # HSDP: two replica groups, each sharded across half the ranks (what is written once per replica group)
        world = dist.get_world_size()
        shape = (2, world // 2) if hybrid else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
        for module in (model.fc1, model.fc2, model):
            fully_shard(module, mesh=mesh)
        self.model = model

    @contextlib.contextmanager
    def syncing(self, sync: bool):
        self.model.set_requires_gradient_sync(sync)
        yield

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor()

    def weights(self) -> dict:
        return {n: self.full(p) for n, p in self.model.named_parameters()}

    def grads(self) -> dict:
        return {n: self.full(p.grad) for n, p in self.model.named_parameters()}

    def state(self, optimizer, key: str) -> dict:
        return {n: self.full(optimizer.state[p][key]) for n, p in self.model.named_parameters()}


class Fsdp1:
    def __init__(self, model: torch.nn.Module, orig_params: bool = True, no_shard: bool = False) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        self.orig_params = orig_params
        self.no_shard = no_shard  # NO_SHARD: every rank holds every parameter, and its moments, whole
        self.shapes = {n: p.shape for n, p in model.named_parameters()}
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        self.fsdp = FSDP
        self.model = FSDP(
            model,
            use_orig_params=orig_params,
            sharding_strategy=ShardingStrategy.NO_SHARD if no_shard else ShardingStrategy.FULL_SHARD,
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
            device_id=torch.device("cpu"),  # on CPU it must be told (else it asks for an accelerator)
        )

    def syncing(self, sync: bool):
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def named(self):
        """The original parameters under the user's names (FSDP's wrapper prefix removed)."""
        return [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in self.model.named_parameters()]

    def _full(self, with_grads: bool) -> dict:
        with self.fsdp.summon_full_params(self.model, with_grads=with_grads):
            return {n: (p.grad if with_grads else p).detach().clone() for n, p in self.named()}

    def weights(self) -> dict:
        return self._full(False)

    def grads(self) -> dict:
        return self._full(True)

    def state(self, optimizer, key: str) -> dict:
        if not self.orig_params:  # flat parameters: FSDP's own full optimizer state, by original name
            full = self.fsdp.optim_state_dict(self.model, optimizer)["state"]
            return {n.replace("_fsdp_wrapped_module.", ""): s[key] for n, s in full.items()}
        return self.gathered_state(optimizer, key)

    def gathered_state(self, optimizer, key: str) -> dict:
        """Each original parameter's moment: its local piece (a 1-D slice of the flat shard, empty
        where this rank holds none) all-gathered and laid out as the flat parameter shards it."""
        out = {}
        for n, p in self.named():
            s = optimizer.state.get(p, {})
            if self.no_shard:
                out[n] = s[key].view(self.shapes[n])
                continue
            piece = s[key].reshape(-1) if key in s else p.detach().new_empty(0)
            pieces = [None] * dist.get_world_size()
            dist.all_gather_object(pieces, piece)
            out[n] = torch.cat(pieces).view(self.shapes[n])
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["fsdp2", "hsdp", "fsdp1", "fsdp1-flat", "fsdp1-noshard"], required=True)
    parser.add_argument("--grad-acc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-sync", action="store_true", help="reduce only the last micro-batch of a step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Uneven()
    reference = Uneven()
    reference.load_state_dict(model.state_dict())
    if args.mode in ("fsdp2", "hsdp"):
        wrapped = Fsdp2(model, hybrid=args.mode == "hsdp")
    else:
        wrapped = Fsdp1(model, orig_params=args.mode != "fsdp1-flat", no_shard=args.mode == "fsdp1-noshard")
    optimizer = torch.optim.Adam(wrapped.model.parameters(), lr=LR, betas=BETAS, eps=EPS)

    gen = torch.Generator().manual_seed(100 + rank)
    truth: dict = {"optimizer": type(optimizer).__name__, "steps": [], "losses": [], "agreement": []}
    for _ in range(args.steps):
        local_sum = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
        for micro in range(args.grad_acc):
            x = torch.randn(4, 8, generator=gen)
            with wrapped.syncing(not args.no_sync or micro == args.grad_acc - 1):
                loss = wrapped.model(x).pow(2).mean() / args.grad_acc
                truth["losses"].append(loss.item())
                loss.backward()
            reference.zero_grad()
            (reference(x).pow(2).mean() / args.grad_acc).backward()
            for n, p in reference.named_parameters():
                local_sum[n] += p.grad
        local_last = {n: stats(p.grad) for n, p in reference.named_parameters()}
        # the gradient agreement by plain torch: this rank's summed gradients against their mean over ranks
        local = torch.cat([g.reshape(-1).double() for g in local_sum.values()])
        mean = local.clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        truth["agreement"].append(
            [float(local @ mean / (local.norm() * mean.norm())), float(local.norm() / mean.norm())]
        )
        local_acc = {n: stats(g) for n, g in local_sum.items()}
        weights = wrapped.weights()
        if args.mode == "fsdp1-flat":  # summon_full_params has no gradients without use_orig_params
            grads = {}
            for n, g in local_sum.items():  # the data-parallel mean of the ranks' gradients, by plain torch
                dist.all_reduce(g)
                grads[n] = g / dist.get_world_size()
        else:
            grads = wrapped.grads()
        moments = wrapped.state(optimizer, "exp_avg") if optimizer.state else None
        record = {
            "param_origin": {n: stats(w) for n, w in weights.items()},
            "grad_reduced": {n: stats(g) for n, g in grads.items()},
            "mg_direction": {n: mg_share(grads[n], moments[n]) for n in grads} if moments else None,
            "local_last": local_last,
            "local_acc": local_acc,
        }
        optimizer.step()
        optimizer.zero_grad()
        weights = wrapped.weights()
        with torch.no_grad():  # the reference follows FSDP's weights: rank-local gradients stay comparable
            for n, p in reference.named_parameters():
                p.copy_(weights[n])
        m, v = wrapped.state(optimizer, "exp_avg"), wrapped.state(optimizer, "exp_avg_sq")
        t = float(next(iter(optimizer.state.values()))["step"])
        ur = {n: update_ratio(m[n], v[n], t) for n in m}
        record.update(
            param_updated={n: stats(w) for n, w in weights.items()},
            exp_avg={n: stats(x) for n, x in m.items()},
            exp_avg_sq={n: stats(x) for n, x in v.items()},
            update={n: u for n, (u, _) in ur.items()},
            ratio={n: r for n, (_, r) in ur.items()},
        )
        truth["steps"].append(record)
    with open(os.path.join(args.out, f"truth_rank{rank}.json"), "w") as fh:
        json.dump(truth, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A DeepSpeed training script with no monitoring code, for `msmon run`: a tiny MLP on 2 CPU
ranks (gloo), ZeRO stage and dtype from the command line.

It saves what DeepSpeed itself assembles for every parameter, in the same run, as the
independent truth: the full fp32 weight before and after each step and the full reduced
gradient (`safe_get_full_fp32_param`, `safe_get_full_grad`), the full Adam moments
(`safe_get_full_optimizer_state`), and, for fp32 runs, the rank-local gradients an unwrapped
copy of the model computes on this rank's micro-batches, and every micro-step's loss (with
`--manual-backward`, also what `engine.scale(loss)` made of it on the odd micro-steps). At stage 0,
where the engine all-reduces `.grad` in place, also the gradient agreement of each step: cos and
|local|/|reduced| of the concatenated gradients, in float64, `local` being the reference model's
summed gradients (fp32) or, in bf16, the `.grad` this script's own post-accumulate hooks clone at
the step's last micro-batch (before the engine reduces it), `reduced` the `.grad` the engine
leaves after that micro-batch's backward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state  # noqa: E402

from conftest import MLP, reference_stats  # noqa: E402


def ds_config(stage: int, dtype: str, grad_acc: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": grad_acc,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10_000,
    }
    if dtype == "autocast16":  # ZeRO-0 under torch.autocast float16: DeepSpeed scales with torch's GradScaler
        config["torch_autocast"] = {"enabled": True, "dtype": "torch.float16"}
    if dtype == "bf16":  # stage 0: FP16_UnfusedOptimizer; stage 1 (fp32 accumulation): BF16_Optimizer
        config["bf16"] = {"enabled": True}
        if stage == 1:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def full_stats(params: dict, getter) -> dict:
    return {name: reference_stats(getter(p).float()) for name, p in params.items()}


def fp32_copies(optimizer) -> dict:
    """FP16_UnfusedOptimizer keeps whole fp32 copies that DeepSpeed's safe_get_* do not see."""
    return {
        id(lp): main
        for lps, mains in zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", []))
        for lp, main in zip(lps, mains)
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "autocast16"], default="fp32")
    parser.add_argument("--grad-acc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--manual-backward", action="store_true", help="engine.scale(loss).backward() on odd micro-steps"
    )
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = MLP()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args.stage, args.dtype, args.grad_acc)
    )
    params = dict(model.named_parameters())
    copies = fp32_copies(optimizer)

    def weight(p):  # stage 0 without a bf16 wrapper: the parameter is the fp32 weight
        if id(p) in copies:
            return copies[id(p)]
        full = safe_get_full_fp32_param(p)
        return p.detach() if full is None else full

    def state(p, key):
        if id(p) in copies:
            return optimizer.optimizer.state[copies[id(p)]][key]
        full = safe_get_full_optimizer_state(p, key)
        return optimizer.state[p][key] if full is None else full

    def mg_share(p):
        """sign(full gradient) == sign(full momentum) before the update; None before the optimizer has a
        state (the same on every rank: both calls below are collectives under ZeRO)."""
        if not getattr(optimizer, "optimizer", optimizer).state:
            return None
        m, g = state(p, "exp_avg"), safe_get_full_grad(p)
        return float((torch.sign(g.double()) == torch.sign(m.double())).double().mean())

    seen: dict[str, torch.Tensor] = {}  # this script's own copy of each rank-local `.grad` (stage 0)
    if args.stage == 0:
        for n, p in params.items():
            p.register_post_accumulate_grad_hook(lambda p, n=n: seen.__setitem__(n, p.grad.detach().clone()))

    gen = torch.Generator().manual_seed(100 + rank)
    truth = {"optimizer": type(optimizer).__name__, "steps": [], "losses": [], "scaled_losses": [], "agreement": []}
    for _ in range(args.steps):
        local_last, local_acc = {}, {}
        for micro in range(args.grad_acc):
            x = torch.randn(2, 8, generator=gen)
            out = engine(x.to(torch.bfloat16) if args.dtype == "bf16" else x)
            loss = out.float().pow(2).mean()
            truth["losses"].append(loss.item())
            if args.manual_backward and micro % 2 == 1:  # DeepSpeed's torch-style backward
                scaled = engine.scale(loss)
                truth["scaled_losses"].append(scaled.item())
                scaled.backward()
            else:
                engine.backward(loss)
            reference.zero_grad()
            (reference(x).pow(2).mean() / args.grad_acc).backward()  # DeepSpeed scales by 1/GAS
            local_last = {n: p.grad.clone() for n, p in reference.named_parameters()}
            for n, g in local_last.items():
                local_acc[n] = local_acc.get(n, 0) + g
            if micro == args.grad_acc - 1 and args.stage == 0:
                own = local_acc if args.dtype == "fp32" else seen
                a = torch.cat([own[n].reshape(-1).double() for n in params])
                b = torch.cat([p.grad.reshape(-1).double() for p in params.values()])
                truth["agreement"].append([float(a @ b / (a.norm() * b.norm())), float(a.norm() / b.norm())])
            if micro == args.grad_acc - 1:
                before = {
                    "grad_reduced": full_stats(params, safe_get_full_grad),
                    "param_origin": full_stats(params, weight),
                    "mg_direction": {n: mg_share(p) for n, p in params.items()},
                }
            engine.step()
        with torch.no_grad():  # keep the reference on DeepSpeed's weights: local gradients stay comparable
            for n, p in reference.named_parameters():
                p.copy_(weight(params[n]))
        inner = getattr(optimizer, "optimizer", optimizer)  # the torch AdamW DeepSpeed steps
        betas, eps, t = (0.9, 0.999), 1e-8, float(next(iter(inner.state.values()))["step"])  # AdamW's defaults
        updates, ratios = {}, {}
        for n, p in params.items():
            m = state(p, "exp_avg").double() / (1 - betas[0] ** t)
            v = (state(p, "exp_avg_sq").double() / (1 - betas[1] ** t)).sqrt()
            updates[n] = reference_stats(m / (v + eps))
            ratios[n] = reference_stats(torch.where(v > 0, m / v, torch.zeros_like(m)))
        record = {
            **before,
            "update": updates,
            "ratio": ratios,
            "param_updated": full_stats(params, weight),
            "exp_avg": full_stats(params, lambda p: state(p, "exp_avg")),
            "exp_avg_sq": full_stats(params, lambda p: state(p, "exp_avg_sq")),
            "local_last": {n: reference_stats(g) for n, g in local_last.items()},
            "local_acc": {n: reference_stats(g) for n, g in local_acc.items()},
        }
        truth["steps"].append(record)
    with open(os.path.join(args.out, f"truth_rank{rank}.json"), "w") as fh:
        json.dump(truth, fh)


if __name__ == "__main__":
    main()

"""The L2 features on an accelerator: no host sync in any hook, values against direct
computations, training unchanged, and what a recorded step costs.

    PYTHONPATH=src python benchmarks/gpu/check_l2_gpu.py [--device cuda] [--dtype bfloat16]

Trains the tests' attention model (larger: d=512, 8 heads, 2 key heads, 4 layers, seq 512) and
MoE model with every hook on. CUDA's sync debugging is "error" during forward and backward; a
sync inside a hook raises there and switches the L2 collector off, so the monitor's failure list
is checked. Prints one JSON line; exit 1 on any failure. On the CPU the sync check is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import l2_reference as direct  # noqa: E402
from l2_models import AttentionLM, MoEModel  # noqa: E402


def run(device: torch.device, dtype: torch.dtype, features: bool, steps: int, out: str) -> dict:
    from msmon import TrainerMon
    from msmon.collectors.l2_features import tensor_math as l2_math

    torch.manual_seed(0)
    model = AttentionLM(vocab=256, d_model=512, heads=8, kv_heads=2, layers=4).to(device, dtype)
    moe = MoEModel(d_in=8, d_model=256, experts=16).to(device, dtype)
    params = list(model.parameters()) + list(moe.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    seen: list = []
    core = model.layers[0].core
    core.register_forward_pre_hook(lambda m, a: seen.append(tuple(t.detach().float().clone() for t in a[:2])))
    mon = None
    if features:
        cfg = {
            "recording_l2_features": True,
            "format": ["api"],
            "l2_targets": {"attention_hook": [f"layers.{i}.core" for i in range(4)], "linear_hook": []},
        }
        path = os.path.join(out, "l2.json")
        with open(path, "w") as fh:
            json.dump(cfg, fh)
        os.environ["MONITOR_OUTPUT_DIR"] = out
        mon = TrainerMon(path)
        mon.set_monitor(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    losses, times, errors = [], [], []
    for step in range(steps):
        idx = torch.randint(0, 256, (4, 512), generator=gen).to(device)
        x = torch.randn(4, 64, 8, generator=gen).to(device, dtype)
        weights = {
            n: m.weight.detach().float().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        started = time.perf_counter()
        loss = F.cross_entropy(model(idx).float().flatten(0, 1), idx.flatten()) + moe(x).float().square().mean()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
        if mon is not None:
            linear = mon.output.metrics("linear_hook")
            attention = mon.output.metrics("attention_hook")
            for name, w in weights.items():
                sigma, _ = direct.spectral(w)
                errors.append(abs(linear[f"0:{name}.linear/rank0/sr"]["kernel_norm"] - sigma) / sigma)
            q, k = (t.cpu() for t in seen[-1])  # layers.0.core's last call, over the very rows the hook read
            l2 = next(c for c in mon.collectors if type(c).__name__ == "L2FeatureCollector")
            (positions,) = [p for key, p in l2._positions.items() if key[0] == "layers.0.core"]
            qb, kb = direct.to_bhsd(q, "s,b,h,d"), direct.to_bhsd(k, "s,b,h,d")
            used, _ = l2_math.attention_rows(qb.shape[0], qb.shape[1], qb.shape[2], kb.shape[2])
            want, _ = direct.attention(qb, kb, positions.cpu() if positions is not None else None, used)
            got = attention["0:layers.0.core.attention:0/rank0/qkt"]["entropy"]
            errors.append(abs(got - want) / want)
    result = {"losses": losses, "step_ms": 1e3 * sorted(times)[len(times) // 2]}
    if mon is not None:
        result.update(failed=sorted(mon.ctx.failed), max_rel_error=max(errors), rows=len(linear) + len(attention))
        mon.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as out:
        plain = run(device, dtype, False, args.steps, out)
        monitored = run(device, dtype, True, args.steps, out)
    tolerance = 2e-3 if dtype == torch.bfloat16 else 1e-3
    report = {
        "device": str(device),
        "dtype": args.dtype,
        "sync_checked": device.type == "cuda",
        "losses_identical": plain["losses"] == monitored["losses"],
        "collectors_switched_off": monitored["failed"],
        "max_rel_error": monitored["max_rel_error"],
        "plain_step_ms": plain["step_ms"],
        "monitored_step_ms": monitored["step_ms"],
    }
    print(json.dumps(report))
    ok = report["losses_identical"] and not report["collectors_switched_off"] and report["max_rel_error"] < tolerance
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

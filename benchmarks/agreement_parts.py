"""Where grad_agreement's time goes, part by part, in one process (no DDP, no torchrun).

    python benchmarks/agreement_parts.py --model gpt-3.7M --repeats 60

The tensor work the agreement does per step on the reference model's gradients, one torch
thread, each part timed alone (thread CPU time, median of the repeats): the copy of the local
gradients into LocalCopies' flat buffer; the dot products alone (one per parameter); the former
sums (that dot per parameter through its dtype conversions, then the reduced norm as one
`_foreach_norm` pass of its own); the present ones (`LocalCopies.sums`: on the CPU per parameter
the dot product and the reduced tensor's own, while it is in the cache; the accelerators'
in-place `_foreach_mul_`, a sum and a `_foreach_norm`); the reduced norm's pass alone; the rest
(the local norms taken as known, the float64 totals, the division); and `of_pairs` whole.

    python benchmarks/agreement_parts.py --paired 150

times the former sums against the present ones instead, alternating in pairs (cold), and gives
the median of the differences and their quartiles. Before each
part a buffer larger than the caches is written (`--cold`, default), so the part reads cold
gradients as it does in a training step, where the backward pass has evicted them; `--warm`
leaves them in the cache. The local gradients are the model's own after one backward pass, the
reduced ones an independent perturbation of them (as another rank's average would be).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _timed(part: Callable[[], object], flush: Callable[[], None] | None, repeats: int) -> float:
    """Median thread CPU milliseconds of `part`, `flush` run untimed before each call."""
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        started = time.thread_time()
        part()
        times.append(1e3 * (time.thread_time() - started))
    return statistics.median(times)


def measure(model_name: str, repeats: int, cold: bool, paired: int = 0) -> dict[str, Any]:
    from workloads import MODELS

    from msmon.collectors.grads.agreement import LocalCopies, _square_sum, of_pairs
    from msmon.stats import device_path

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = MODELS[model_name]
    model = spec.build()
    from tiny_gpt import lm_loss

    lm_loss(model, spec.batch_of(torch.Generator().manual_seed(0), torch.device("cpu"))).backward()
    params = {i: p for i, p in enumerate(model.parameters()) if p.grad is not None}
    local = {i: p.grad.detach().clone() for i, p in params.items()}
    reduced = {i: 0.5 * g + 0.1 * torch.randn_like(g) for i, g in local.items()}
    norms = {i: g.norm() for i, g in local.items()}  # grad_unreduced's rows hold these
    copies = LocalCopies(params)
    kept = {i: copies.copy(i, g) for i, g in local.items()}
    pairs = {i: (kept[i], reduced[i]) for i in kept}
    sink = torch.empty(64 * 2**20 // 4)  # 64 MiB, more than the last-level cache
    flush = (lambda: sink.fill_(1.0)) if cold else None

    def copy() -> None:
        for i, g in local.items():
            copies.copy(i, g)

    def sums_in_place() -> None:  # the accelerators' route (MSMON_DEVICE_PATH=1)
        os.environ[device_path.ENV] = "1"
        device_path.refresh()
        try:
            copies.sums(pairs)
        finally:
            del os.environ[device_path.ENV]
            device_path.refresh()

    def dots_alone() -> None:
        torch.stack([torch.dot(a.reshape(-1), b.reshape(-1)) for a, b in pairs.values()]).double().sum()

    def former() -> None:  # main before this change: a dot per parameter, then the reduced norm's own pass
        f32 = torch.float32
        torch.stack([torch.dot(a.reshape(-1).to(f32), b.reshape(-1).to(f32)).double() for a, b in pairs.values()]).sum()
        _square_sum(list(reduced.values()))

    def rest() -> None:  # of_pairs with the dot and both norms given: totals, stack, division
        known_sq = torch.stack(list(norms.values())).double().square().sum()
        dot = torch.ones((), dtype=torch.float64)
        local_norm, reduced_norm = known_sq.sqrt(), known_sq.sqrt()
        return dot / (local_norm * reduced_norm), local_norm / reduced_norm

    numel = sum(g.numel() for g in local.values())
    if paired:  # the former sums against the present ones, alternating, cold: the differences
        differences = []
        for r in range(paired):
            found = {}
            for name, part in (("former", former), ("present", lambda: copies.sums(pairs)))[:: 1 if r % 2 else -1]:
                sink.fill_(1.0)
                started = time.thread_time()
                part()
                found[name] = 1e3 * (time.thread_time() - started)
            differences.append(found["present"] - found["former"])
        quartiles = statistics.quantiles(differences, n=4)
        return {"pairs": paired, "present_minus_former_ms": statistics.median(differences), "quartiles": quartiles}
    result = {
        "parameters": len(local),
        "floats": numel,
        "copy_ms": _timed(copy, flush, repeats),
        "dots_alone_ms": _timed(dots_alone, flush, repeats),
        "former_dots_then_reduced_norm_ms": _timed(former, flush, repeats),
        "sums_per_parameter_ms": _timed(lambda: copies.sums(pairs), flush, repeats),
        "sums_in_place_ms": _timed(sums_in_place, flush, repeats),
        "reduced_norm_foreach_ms": _timed(lambda: _square_sum(list(reduced.values())), flush, repeats),
        "rest_ms": _timed(rest, flush, repeats),
        "of_pairs_ms": _timed(lambda: of_pairs(pairs, norms, copies), flush, repeats),
    }
    for i, g in local.items():  # the in-place dot spent the copies
        copies.copy(i, g)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-3.7M")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--warm", action="store_true", help="leave the gradients in the cache")
    parser.add_argument("--paired", type=int, default=0, help="this many pairs: former sums against present ones")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    result = {"model": args.model, "cold": not args.warm, "load": os.getloadavg()}
    result.update(measure(args.model, args.repeats, not args.warm, args.paired))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

"""Where grad_agreement's time goes, part by part, in one process (no DDP, no torchrun).

    python benchmarks/agreement_parts.py --model gpt-3.7M --repeats 60

The tensor work the agreement does per step on the reference model's gradients, one torch
thread, each part timed alone (thread CPU time, median of the repeats): the copy of the local
gradients into LocalCopies' flat buffer, the dot product (per-parameter dots, the CPU's way,
and the accelerators' in-place `_foreach_mul_` and sum), the reduced gradients' norm
(`_foreach_norm`, what the agreement read before it took grad_reduced's rows), the rest (the
local norms taken as known, the float64 totals, the division), and the whole of the sums both
ways: the reduced norm read (`of_pairs`) and taken from the step's grad_reduced rows
(`partial_of_pairs` and `Partial.finish`; the rows themselves are computed untimed, as
grad_reduced computes them anyway). Before each
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
from typing import Callable

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


def measure(model_name: str, repeats: int, cold: bool) -> dict[str, float]:
    from workloads import MODELS

    from msmon.collectors import grad_agreement
    from msmon.collectors.grad_agreement import LocalCopies, _square_sum, of_pairs, partial_of_pairs

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

    def dot_in_place() -> None:
        grad_agreement.IN_PLACE_ON_CPU = True
        try:
            copies.dot(pairs)
        finally:
            grad_agreement.IN_PLACE_ON_CPU = False

    def rest() -> None:  # of_pairs with the dot and both norms given: totals, stack, division
        known_sq = torch.stack(list(norms.values())).double().square().sum()
        dot = torch.ones((), dtype=torch.float64)
        local_norm, reduced_norm = known_sq.sqrt(), known_sq.sqrt()
        return dot / (local_norm * reduced_norm), local_norm / reduced_norm

    from msmon.collectors.reduced_rows import ReducedRows
    from msmon.stats.sparse import any_layout_stats

    ops = ["norm", "min", "max", "mean", "zeros", "nans"]
    rows = ReducedRows([], list(reduced), list(reduced.values()), any_layout_stats(list(reduced.values()), ops, 0.0))

    def from_rows() -> None:  # the reduced norm from the step's grad_reduced rows (computed anyway, untimed)
        partial = partial_of_pairs(pairs, norms, copies, norm_later=True)
        assert partial is not None
        partial.finish(rows.described(), rows.column(ops))

    numel = sum(g.numel() for g in local.values())
    result = {
        "parameters": len(local),
        "floats": numel,
        "copy_ms": _timed(copy, flush, repeats),
        "dot_per_parameter_ms": _timed(lambda: copies.dot(pairs), flush, repeats),
        "dot_in_place_ms": _timed(dot_in_place, flush, repeats),
        "reduced_norm_foreach_ms": _timed(lambda: _square_sum(list(reduced.values())), flush, repeats),
        "local_norm_foreach_ms": _timed(lambda: _square_sum(list(local.values())), flush, repeats),
        "rest_ms": _timed(rest, flush, repeats),
        "of_pairs_norm_read_ms": _timed(lambda: of_pairs(pairs, norms, copies), flush, repeats),
        "of_pairs_norm_from_rows_ms": _timed(from_rows, flush, repeats),
    }
    for i, g in local.items():  # the in-place dot spent the copies
        copies.copy(i, g)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-3.7M")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--warm", action="store_true", help="leave the gradients in the cache")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    result = {"model": args.model, "cold": not args.warm, "load": os.getloadavg()}
    result.update(measure(args.model, args.repeats, not args.warm))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

"""The replica check's fingerprints on a GPU: bit-exact against the CPU, no host sync, and their cost.

    python benchmarks/gpu/check_fingerprint_gpu.py [--json out.json]

1. For float32, bfloat16 (even and odd length, odd storage offset), float16, float64, int64,
   uint8 and bool tensors, small and several rows long, the CUDA fingerprint equals the CPU one
   (int64 arithmetic must wrap the same way on both).
2. Fingerprinting a model's weights and starting their copy to pinned host memory, as a check
   step does, runs under `torch.cuda.set_sync_debug_mode("error")`: any host sync raises.
3. The time of one check step's device work (fingerprints of all weights) for the benchmark's
   models and a 1-billion-element bfloat16 tensor, median of 20 CUDA-event timings.
Exit code 0 when 1 and 2 hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "src"))
from workloads import MODELS  # noqa: E402

from msmon.stats.fingerprint import COLUMNS, Fingerprinter  # noqa: E402


def cases() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    n = 3 * COLUMNS + 123
    return {
        "float32": torch.randn(n),
        "float32 small": torch.randn(7, 5),
        "bfloat16 even": torch.randn(2 * n).to(torch.bfloat16),
        "bfloat16 odd": torch.randn(n).to(torch.bfloat16),
        "bfloat16 odd offset": torch.randn(n + 1).to(torch.bfloat16)[1:],
        "float16": torch.randn(64, 33).half(),
        "float64": torch.randn(n, dtype=torch.float64),
        "int64": torch.randint(-(2**62), 2**62, (n,)),
        "uint8": torch.randint(0, 256, (n,), dtype=torch.uint8),
        "bool": torch.rand(101) > 0.5,
    }


def timed(fn, count: int = 20) -> float:
    times = []
    for _ in range(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "exact": {}, "ms": {}}
    cpu_fp, gpu_fp = Fingerprinter(), Fingerprinter()
    tensors = cases()
    for name, t in tensors.items():
        result["exact"][name] = cpu_fp([t]).item() == gpu_fp([t.to(device)]).item()
    batched = gpu_fp([t.to(device) for t in tensors.values()]).cpu().tolist()
    result["exact"]["one batched call"] = batched == [cpu_fp([t]).item() for t in tensors.values()]

    model = MODELS["gpt-58M"].build().to(device)
    params = list(model.parameters())
    gpu_fp(params)  # tables, plan and index tensors are made once, outside the check
    host = torch.empty(len(params), dtype=torch.int64, pin_memory=True)
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        fps = gpu_fp(params)
        host.copy_(fps, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        torch.cuda.set_sync_debug_mode(0)
        result["no_host_sync"] = True
    except RuntimeError as exc:
        torch.cuda.set_sync_debug_mode(0)
        result["no_host_sync"] = False
        result["sync_error"] = str(exc)
    for name, spec in MODELS.items():
        weights = list(spec.build().to(device).parameters())
        gpu_fp(weights)
        result["ms"][f"{name} weights ({sum(p.numel() for p in weights):,} elements)"] = timed(lambda: gpu_fp(weights))  # noqa: B023
    big = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
    gpu_fp([big])
    result["ms"]["one bfloat16 tensor of 2^30 elements"] = timed(lambda: gpu_fp([big]), 5)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0 if all(result["exact"].values()) and result["no_host_sync"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Experiment, not part of msmon: what a fused native kernel would save on the CPU.

    python benchmarks/fused_kernel_experiment.py [--threads 2]

msmon's statistics are torch reductions, one kernel per op (norm, aminmax, sum, and three
for the zero count), each reading the tensor again. This builds (torch.utils.cpp_extension,
about a minute with g++) a single-pass C++ kernel computing the same float32 statistics,
then measures, in one process and alternating steps, the monitor's own clock per step on the
reference model with `wg` and per-micro-step gradient rows (so every gradient goes through
`tensor_stats` in its hook) for the current path and for the fused kernel. It needs a C++
compiler; docs/performance.md reports its numbers and why msmon does not ship it (yet).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_worker import attach  # noqa: E402
from workloads import MODELS, monitor_config, train_step  # noqa: E402

import msmon.collectors.grads as grads  # noqa: E402
from msmon.stats import zero_threshold  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>

// One pass over a contiguous float32 tensor: norm, min, max, sum, #(|x| < th), #NaN, #Inf.
torch::Tensor fused_stats(torch::Tensor x, double th) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat, "contiguous float32 only");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  const float thf = static_cast<float>(th);
  double s = 0, ss = 0;
  float mn = INFINITY, mx = -INFINITY;
  int64_t zeros = 0, nans = 0, infs = 0;
  for (int64_t b = 0; b < n; b += 1024) {  // float partials per block, double across blocks
    const int64_t e = std::min(n, b + 1024);
    float ls = 0, lss = 0, lmn = INFINITY, lmx = -INFINITY;
    int32_t lz = 0, ln = 0, li = 0;
    #pragma omp simd reduction(+:ls, lss, lz, ln, li) reduction(min:lmn) reduction(max:lmx)
    for (int64_t i = b; i < e; ++i) {
      const float v = p[i];
      ls += v;
      lss += v * v;
      lmn = v < lmn ? v : lmn;
      lmx = v > lmx ? v : lmx;
      lz += std::fabs(v) < thf;
      ln += v != v;
      li += std::fabs(v) == INFINITY;
    }
    s += ls; ss += lss; mn = std::min(mn, lmn); mx = std::max(mx, lmx); zeros += lz; nans += ln; infs += li;
  }
  auto out = torch::empty({7}, torch::kDouble);
  double* o = out.data_ptr<double>();
  o[0] = std::sqrt(ss); o[1] = mn; o[2] = mx; o[3] = s; o[4] = zeros; o[5] = nans; o[6] = infs;
  return out;
}
"""
COLUMN = {"norm": 0, "min": 1, "max": 2, "mean": 3, "zeros": 4, "nans": 5, "infs": 6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20, help="alternating steps per variant")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    native = load_inline("msmon_fused_stats_experiment", cpp_sources=SOURCE, functions=["fused_stats"],
                         extra_cflags=["-O3", "-march=native", "-fopenmp-simd"])
    print(f"built in {time.time() - started:.0f} s")

    def fused_tensor_stats(t: torch.Tensor, ops, eps: float) -> torch.Tensor:
        raw = native.fused_stats(t.detach(), zero_threshold(eps, t.dtype))
        scale = torch.tensor([float(t.numel()) if op in ("mean", "zeros") else 1.0 for op in ops], dtype=torch.float64)
        return raw[[COLUMN[op] for op in ops]] / scale

    current = grads.tensor_stats
    spec = MODELS["gpt-3.7M"]
    torch.manual_seed(0)
    model = spec.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = dict(monitor_config("wg", model), monitor_mbs_grad=True)
    with tempfile.TemporaryDirectory() as workdir:
        monitor = attach("msmon", config, model, optimizer, workdir)
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            train_step(model, optimizer, spec.batch_of(gen, torch.device("cpu")))
        clock: dict[str, list[float]] = {"torch ops": [], "fused kernel": []}
        for i in range(args.steps):
            for name in (("torch ops", "fused kernel") if i % 2 else ("fused kernel", "torch ops")):
                grads.tensor_stats = current if name == "torch ops" else fused_tensor_stats
                monitor.cost.seconds = 0.0
                train_step(model, optimizer, spec.batch_of(gen, torch.device("cpu")))
                clock[name].append(1e3 * monitor.cost.seconds)
        grads.tensor_stats = current
        monitor.close()
    for name, values in clock.items():
        values.sort()
        print(f"{name:13s} monitor ms/step: median {values[len(values) // 2]:.2f}, min {values[0]:.2f}")


if __name__ == "__main__":
    main()

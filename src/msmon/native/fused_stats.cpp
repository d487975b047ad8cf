// msmon's optional one-pass statistics for contiguous CPU tensors (MSMON_NATIVE_STATS=1).
//
// torch computes each statistic in its own pass (norm, aminmax, sum, and three kernels for
// the zero count); this reads the tensor once. Results match msmon.stats to rounding:
// min/max are exact and propagate NaN like torch.aminmax, counts are exact, the norm and the
// sum accumulate in float32 within blocks of 1024 elements and in float64 across blocks.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

constexpr int64_t kBlock = 1024;

template <typename scalar_t, typename acc_t>
torch::Tensor stats_of(const scalar_t* p, int64_t n, double threshold) {
  const scalar_t th = static_cast<scalar_t>(threshold);
  double sumsq = 0, sum = 0;
  scalar_t lo = std::numeric_limits<scalar_t>::infinity();
  scalar_t hi = -std::numeric_limits<scalar_t>::infinity();
  int64_t zeros = 0, nans = 0, infs = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    acc_t s = 0, ss = 0;
    scalar_t l = std::numeric_limits<scalar_t>::infinity();
    scalar_t h = -std::numeric_limits<scalar_t>::infinity();
    int32_t z = 0, na = 0, in = 0;
#pragma omp simd reduction(+ : s, ss, z, na, in) reduction(min : l) reduction(max : h)
    for (int64_t i = b; i < e; ++i) {
      const scalar_t v = p[i];
      s += v;
      ss += static_cast<acc_t>(v) * v;
      l = v < l ? v : l;  // NaN never wins a comparison: counted below and propagated at the end
      h = v > h ? v : h;
      const scalar_t a = std::fabs(v);
      z += a < th;
      na += v != v;
      in += a == std::numeric_limits<scalar_t>::infinity();
    }
    sum += s;
    sumsq += ss;
    lo = std::min(lo, l);
    hi = std::max(hi, h);
    zeros += z;
    nans += na;
    infs += in;
  }
  auto out = torch::empty({7}, torch::kDouble);
  double* o = out.data_ptr<double>();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  o[0] = std::sqrt(sumsq);
  o[1] = nans ? nan : static_cast<double>(lo);
  o[2] = nans ? nan : static_cast<double>(hi);
  o[3] = sum;
  o[4] = static_cast<double>(zeros);
  o[5] = static_cast<double>(nans);
  o[6] = static_cast<double>(infs);
  return out;
}

}  // namespace

// [norm, min, max, sum, count(|x| < threshold), count(NaN), count(Inf)] as float64.
torch::Tensor fused_stats(const torch::Tensor& x, double threshold) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "fused_stats: a contiguous CPU tensor");
  TORCH_CHECK(x.numel() > 0, "fused_stats: an empty tensor");
  if (x.scalar_type() == torch::kFloat) {
    return stats_of<float, float>(x.data_ptr<float>(), x.numel(), threshold);
  }
  TORCH_CHECK(x.scalar_type() == torch::kDouble, "fused_stats: float32 or float64");
  return stats_of<double, double>(x.data_ptr<double>(), x.numel(), threshold);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_stats", &fused_stats, "one-pass statistics of a contiguous CPU float tensor");
}

// msmon's optional one-pass statistics for contiguous CPU tensors (MSMON_NATIVE_STATS=1).
//
// torch computes each statistic in its own pass (norm, aminmax, sum, and three kernels for
// the zero count); this reads each tensor once. Results match msmon.stats to rounding:
// min/max are exact and propagate NaN like torch.aminmax, counts are exact, the norm and the
// sum accumulate in float32 within blocks of 1024 elements and in float64 across blocks.
//
// Three things keep it cheap on a busy training host:
// - a whole batch of tensors is one call, so Python pays one call and one result per batch,
//   and the result comes back in the caller's columns, scaled, so no further kernels follow;
// - the loop is compiled twice, for baseline x86-64 and for AVX2+FMA, and the CPU picks at run
//   time: the build cache stays portable across nodes and AVX2 machines get 8-wide vectors;
// - the GIL is released while reading, so the writer thread is not held up by the statistics.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 1024;
constexpr int kFields = 7;  // norm, min, max, sum, zeros, nans, infs

template <typename scalar_t, typename acc_t>
__attribute__((always_inline)) inline void stats_of(const scalar_t* p, int64_t n, double threshold, double* o) {
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
  const double nan = std::numeric_limits<double>::quiet_NaN();
  o[0] = std::sqrt(sumsq);
  o[1] = nans ? nan : static_cast<double>(lo);
  o[2] = nans ? nan : static_cast<double>(hi);
  o[3] = sum;
  o[4] = static_cast<double>(zeros);
  o[5] = static_cast<double>(nans);
  o[6] = static_cast<double>(infs);
}

struct Input {
  const void* data;
  int64_t numel;
  bool is_double;
};

// The same loop for every input; `inline` into each target-specific caller below, so each
// caller's instruction set decides the vector width.
__attribute__((always_inline)) inline void fill(const std::vector<Input>& inputs, double threshold, double* out) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Input& in = inputs[i];
    double* o = out + i * kFields;
    if (in.is_double) {
      stats_of<double, double>(static_cast<const double*>(in.data), in.numel, threshold, o);
    } else {
      stats_of<float, float>(static_cast<const float*>(in.data), in.numel, threshold, o);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) void fill_avx2(const std::vector<Input>& inputs, double threshold, double* out) {
  fill(inputs, threshold, out);
}
#endif

void fill_baseline(const std::vector<Input>& inputs, double threshold, double* out) { fill(inputs, threshold, out); }

void fill_best(const std::vector<Input>& inputs, double threshold, double* out) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) {
    fill_avx2(inputs, threshold, out);
    return;
  }
#endif
  fill_baseline(inputs, threshold, out);
}

Input input_of(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "fused_stats: a contiguous CPU tensor");
  TORCH_CHECK(x.numel() > 0, "fused_stats: an empty tensor");
  const auto type = x.scalar_type();
  TORCH_CHECK(type == torch::kFloat || type == torch::kDouble, "fused_stats: float32 or float64");
  return Input{x.data_ptr(), x.numel(), type == torch::kDouble};
}

// Tensors are checked and their pointers taken while the GIL is held; only the reading runs
// without it (the tensors stay alive: the caller holds them for the whole call).
std::vector<Input> inputs_of(const std::vector<torch::Tensor>& xs) {
  std::vector<Input> inputs;
  inputs.reserve(xs.size());
  for (const auto& x : xs) {
    inputs.push_back(input_of(x));
  }
  return inputs;
}

void fill_unlocked(const std::vector<Input>& inputs, double threshold, double* out) {
  pybind11::gil_scoped_release no_gil;
  fill_best(inputs, threshold, out);
}

}  // namespace

// [norm, min, max, sum, count(|x| < threshold), count(NaN), count(Inf)] as float64.
torch::Tensor fused_stats(const torch::Tensor& x, double threshold) {
  auto out = torch::empty({kFields}, torch::kDouble);
  fill_unlocked(inputs_of({x}), threshold, out.data_ptr<double>());
  return out;
}

// The same for many tensors: one [len(xs), 7] float64 tensor, a row per input.
torch::Tensor fused_stats_many(const std::vector<torch::Tensor>& xs, double threshold) {
  auto out = torch::empty({static_cast<int64_t>(xs.size()), kFields}, torch::kDouble);
  fill_unlocked(inputs_of(xs), threshold, out.data_ptr<double>());
  return out;
}

// Finished rows in the caller's column order: columns[j] is the field (0..6) of column j, and
// where per_element[j] is set the field is divided by the tensor's element count (the mean
// from the sum, the zero fraction from the count). [len(xs), len(columns)] float64, or
// [len(columns)] when `flat` (one tensor). This is what the monitor records, without further
// kernels on the Python side.
torch::Tensor stats_rows(const std::vector<torch::Tensor>& xs, double threshold, const std::vector<int64_t>& columns,
                         const std::vector<bool>& per_element, bool flat) {
  TORCH_CHECK(columns.size() == per_element.size(), "stats_rows: one per_element flag per column");
  for (const int64_t c : columns) {
    TORCH_CHECK(c >= 0 && c < kFields, "stats_rows: a column is a field index 0..6");
  }
  TORCH_CHECK(!flat || xs.size() == 1, "stats_rows: flat output is for one tensor");
  const auto inputs = inputs_of(xs);
  std::vector<double> fields(inputs.size() * kFields);
  fill_unlocked(inputs, threshold, fields.data());
  const int64_t width = static_cast<int64_t>(columns.size());
  auto out = flat ? torch::empty({width}, torch::kDouble)
                  : torch::empty({static_cast<int64_t>(inputs.size()), width}, torch::kDouble);
  double* o = out.data_ptr<double>();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const double count = static_cast<double>(inputs[i].numel);
    for (int64_t j = 0; j < width; ++j) {
      const double v = fields[i * kFields + columns[j]];
      o[i * width + j] = per_element[j] ? v / count : v;
    }
  }
  return out;
}

// Which instruction set the reading loop runs with on this CPU (for the benchmark's record).
std::string isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return "avx2";
  }
#endif
  return "baseline";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_stats", &fused_stats, "one-pass statistics of a contiguous CPU float tensor");
  m.def("fused_stats_many", &fused_stats_many, "one-pass statistics of many contiguous CPU float tensors");
  m.def("stats_rows", &stats_rows, "finished statistic rows of contiguous CPU float tensors, in the caller's columns");
  m.def("isa", &isa, "the instruction set the statistics loop uses on this CPU");
}

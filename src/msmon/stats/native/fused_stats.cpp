// msmon's one-pass statistics for contiguous CPU float32/float64 arrays (msmon.native).
//
// torch computes each statistic in its own pass (norm, aminmax, sum, and three kernels for
// the zero count); this reads each tensor once. Results match msmon.stats to rounding:
// min/max are exact and propagate NaN like torch.aminmax, counts are exact, the norm and the
// sum accumulate within blocks of 1024 elements in the input's precision (float32 for float32,
// float64 for float64) and in float64 across blocks.
//
// Plain C++ behind a C ABI, no torch or Python header: it compiles in a second or two with
// the system compiler and msmon.native loads it with ctypes (which releases the GIL for the
// call, so the writer thread is not held up by the statistics). Three things keep it cheap
// on a busy training host:
// - a whole batch of tensors is one call, so Python pays one call and one result per batch,
//   and the result comes back in the caller's columns, divided by the element count where the
//   caller asks (tensor_stats does; batch_stats takes sums and counts and divides them itself);
// - the loop is compiled twice, for baseline x86-64 and for AVX2+FMA, and the CPU picks at run
//   time: the build cache stays portable across nodes and AVX2 machines get 8-wide vectors;
// - large batches can be shared by a few threads, cut at block boundaries: torch's own
//   OpenMP team where msmon finds its runtime, else threads of the kernel's own;
// - each block's successor is prefetched while the block is reduced, so a tensor coming from
//   memory is not read at the pace of one cache miss after another.
// The CSV sink's rounding of a step's values is here too (msmon_csv_round, at the end): in
// torch ops it made the writer thread load kernels nothing else in the process runs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kBlock = 1024;
constexpr int64_t kLine = 64;  // bytes per cache line
constexpr int kFields = 7;  // norm, min, max, sum, zeros, nans, infs

// What one stretch of a tensor contributes; stretches combine exactly (counts, min, max) or
// in float64 (sums).
struct Partial {
  double sum = 0, sumsq = 0;
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  int64_t zeros = 0, nans = 0, infs = 0;

  void add(const Partial& o) {
    sum += o.sum;
    sumsq += o.sumsq;
    lo = std::min(lo, o.lo);
    hi = std::max(hi, o.hi);
    zeros += o.zeros;
    nans += o.nans;
    infs += o.infs;
  }

  void write(double* o) const {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    o[0] = std::sqrt(sumsq);
    o[1] = nans ? nan : lo;  // NaN never wins stats_of's comparisons: propagated here, like aminmax
    o[2] = nans ? nan : hi;
    o[3] = sum;
    o[4] = static_cast<double>(zeros);
    o[5] = static_cast<double>(nans);
    o[6] = static_cast<double>(infs);
  }
};

template <typename scalar_t, typename acc_t>
__attribute__((always_inline)) inline Partial stats_of(const scalar_t* p, int64_t begin, int64_t end,
                                                       double threshold) {
  const scalar_t th = static_cast<scalar_t>(threshold);
  Partial out;
  scalar_t lo = std::numeric_limits<scalar_t>::infinity();
  scalar_t hi = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = std::min(end, b + kBlock);
    // the next block's cache lines are asked for while this one is reduced: measured on the
    // reference model's 53 weights read from memory, 2.2 -> 1.7 ms (docs/performance.md); the
    // reduction itself is unchanged, so are its results
    for (int64_t f = e; f < std::min(end, e + kBlock); f += kLine / static_cast<int64_t>(sizeof(scalar_t))) {
      __builtin_prefetch(p + f);
    }
    // two independent chains, one per half of the block: one accumulator waits on each
    // add's latency; more than two run out of vector registers
    const int64_t q = (e - b) / 2;
    const scalar_t* p0 = p + b;
    const scalar_t* p1 = p0 + q;
    acc_t s0 = 0, s1 = 0, ss0 = 0, ss1 = 0;
    scalar_t l0 = std::numeric_limits<scalar_t>::infinity(), l1 = l0;
    scalar_t h0 = -std::numeric_limits<scalar_t>::infinity(), h1 = h0;
    int32_t z0 = 0, z1 = 0;
#pragma omp simd reduction(+ : s0, s1, ss0, ss1, z0, z1) reduction(min : l0, l1) reduction(max : h0, h1)
    for (int64_t j = 0; j < q; ++j) {
      const scalar_t v0 = p0[j], v1 = p1[j];
      s0 += v0;
      s1 += v1;
      ss0 += static_cast<acc_t>(v0) * v0;
      ss1 += static_cast<acc_t>(v1) * v1;
      l0 = v0 < l0 ? v0 : l0;
      l1 = v1 < l1 ? v1 : l1;
      h0 = v0 > h0 ? v0 : h0;
      h1 = v1 > h1 ? v1 : h1;
      z0 += std::fabs(v0) < th;
      z1 += std::fabs(v1) < th;
    }
    if ((e - b) % 2) {  // the block's odd last element
      const scalar_t v = p[e - 1];
      s0 += v;
      ss0 += static_cast<acc_t>(v) * v;
      l0 = v < l0 ? v : l0;
      h0 = v > h0 ? v : h0;
      z0 += std::fabs(v) < th;
    }
    const acc_t s = s0 + s1, ss = ss0 + ss1;
    // NaN never wins a comparison: a NaN element leaves l and h as they were; the nan count
    // below makes min and max NaN (Partial::write)
    const scalar_t l = std::min(l0, l1);
    const scalar_t h = std::max(h0, h1);
    const int32_t z = z0 + z1;
    int32_t na = 0, in = 0;
    // A NaN or an infinity makes the sum of squares non-finite, so only then are they
    // counted, in a second pass over the block while it is in L1 (a finite sum of squares
    // that overflowed is counted too, and finds none): the common block does a third less work.
    if (!std::isfinite(ss)) {
#pragma omp simd reduction(+ : na, in)
      for (int64_t i = b; i < e; ++i) {
        const scalar_t v = p[i];
        na += v != v;
        in += std::fabs(v) == std::numeric_limits<scalar_t>::infinity();
      }
    }
    out.sum += s;
    out.sumsq += ss;
    lo = std::min(lo, l);
    hi = std::max(hi, h);
    out.zeros += z;
    out.nans += na;
    out.infs += in;
  }
  out.lo = static_cast<double>(lo);
  out.hi = static_cast<double>(hi);
  return out;
}

struct Input {
  const void* data;
  int64_t numel;
  int64_t type;  // 0 float32, 1 float64, 2 float32 summed in float64 (a derived op's bases: std)
};

// A stretch of one input, read by one thread.
struct Piece {
  size_t input;
  int64_t begin, end;
};

// The same loop for every piece; `inline` into each target-specific caller below, so each
// caller's instruction set decides the vector width.
__attribute__((always_inline)) inline void read_pieces(const std::vector<Input>& inputs, const Piece* pieces,
                                                       size_t count, double threshold, Partial* out) {
  for (size_t k = 0; k < count; ++k) {
    const Piece& piece = pieces[k];
    const Input& in = inputs[piece.input];
    if (in.type == 1) {
      out[k] = stats_of<double, double>(static_cast<const double*>(in.data), piece.begin, piece.end, threshold);
    } else if (in.type == 2) {
      out[k] = stats_of<float, double>(static_cast<const float*>(in.data), piece.begin, piece.end, threshold);
    } else {
      out[k] = stats_of<float, float>(static_cast<const float*>(in.data), piece.begin, piece.end, threshold);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) void read_avx2(const std::vector<Input>& inputs, const Piece* pieces,
                                                     size_t count, double threshold, Partial* out) {
  read_pieces(inputs, pieces, count, threshold, out);
}
#endif

void read_baseline(const std::vector<Input>& inputs, const Piece* pieces, size_t count, double threshold,
                   Partial* out) {
  read_pieces(inputs, pieces, count, threshold, out);
}

void read_best(const std::vector<Input>& inputs, const Piece* pieces, size_t count, double threshold,
               Partial* out) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) {
    read_avx2(inputs, pieces, count, threshold, out);
    return;
  }
#endif
  read_baseline(inputs, pieces, count, threshold, out);
}

// The training's own OpenMP team, when msmon found the runtime torch runs on
// (msmon_stats_use_team): its workers are already awake, spinning after torch's last parallel
// op, so a share handed to them starts at once. A thread of our own would instead compete with
// a spinning worker for the same core and read nothing faster (docs/performance.md).
struct Team {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;  // GOMP_parallel
  int (*thread_num)() = nullptr;  // omp_get_thread_num
  int (*num_threads)() = nullptr;  // omp_get_num_threads
};
Team team;

// One call's shares: share t is pieces[first[t] .. first[t + 1]).
struct Shares {
  const std::vector<Input>* inputs;
  const Piece* pieces;
  const size_t* first;
  size_t count;
  double threshold;
  Partial* partials;
};

void read_share(const Shares& s, size_t t) {
  const size_t a = s.first[t], b = s.first[t + 1];
  read_best(*s.inputs, s.pieces + a, b - a, s.threshold, s.partials + a);
}

// Run by every thread of the team; the runtime may give fewer threads than asked for, so
// each takes every team-size-th share.
void read_shares(void* data) {
  const Shares& s = *static_cast<const Shares*>(data);
  const size_t size = static_cast<size_t>(std::max(1, team.num_threads()));
  for (size_t t = static_cast<size_t>(team.thread_num()); t < s.count; t += size) {
    read_share(s, t);
  }
}

// Every input's fields into out[i * 7 ...]. With threads > 1 and at least min_share elements
// per thread, the elements are cut into equal shares (at block boundaries, whole inputs where
// they fit) and read by that many threads, this one included; the result does not depend on
// how the work was shared beyond the order of float64 additions.
void fill(const std::vector<Input>& inputs, double threshold, int threads, int64_t min_share, double* out) {
  int64_t total = 0;
  for (const Input& in : inputs) {
    total += in.numel;
  }
  const int64_t wanted = std::max<int64_t>(1, std::min<int64_t>(threads, total / std::max<int64_t>(min_share, kBlock)));
  const int64_t share = (total + wanted - 1) / wanted;
  // pieces in input order, each ending at a share boundary or at its input's end
  std::vector<Piece> pieces;
  std::vector<size_t> first_of_share{0};
  int64_t position = 0;  // elements before the current piece, over all inputs
  for (size_t i = 0; i < inputs.size(); ++i) {
    int64_t begin = 0;
    while (begin < inputs[i].numel) {
      const int64_t boundary = (position / share + 1) * share;  // the end of the current share
      int64_t end = std::min(inputs[i].numel, begin + (boundary - position));
      if (end < inputs[i].numel) {  // cut at the next block boundary: a share may run a block long
        end = std::min(inputs[i].numel, (end + kBlock - 1) / kBlock * kBlock);
      }
      pieces.push_back(Piece{i, begin, end});
      position += end - begin;
      begin = end;
      if (position >= boundary && position < total) {
        first_of_share.push_back(pieces.size());
      }
    }
  }
  first_of_share.push_back(pieces.size());
  std::vector<Partial> partials(pieces.size());
  Shares shares{&inputs, pieces.data(), first_of_share.data(), first_of_share.size() - 1, threshold, partials.data()};
  if (shares.count > 1 && team.parallel != nullptr) {
    team.parallel(read_shares, &shares, static_cast<unsigned>(shares.count), 0);
  } else {
    std::vector<std::thread> helpers;
    for (size_t t = 1; t < shares.count; ++t) {
      helpers.emplace_back([&shares, t] { read_share(shares, t); });
    }
    read_share(shares, 0);
    for (auto& helper : helpers) {
      helper.join();
    }
  }
  std::vector<Partial> totals(inputs.size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    totals[pieces[k].input].add(partials[k]);
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    totals[i].write(out + i * kFields);
  }
}

}  // namespace

extern "C" {

// Bumped whenever a signature below changes or a function is added; the loader checks it.
int msmon_stats_abi(void) { return 4; }

// Share large calls with an OpenMP team from now on (the addresses of the runtime's
// GOMP_parallel, omp_get_thread_num and omp_get_num_threads), or with threads of our own
// again (any of them null). Set before statistics are asked for: not for concurrent calls.
void msmon_stats_use_team(void* parallel, void* thread_num, void* num_threads) {
  if (parallel == nullptr || thread_num == nullptr || num_threads == nullptr) {
    team = Team{};
    return;
  }
  team.parallel = reinterpret_cast<void (*)(void (*)(void*), void*, unsigned, unsigned)>(parallel);
  team.thread_num = reinterpret_cast<int (*)()>(thread_num);
  team.num_threads = reinterpret_cast<int (*)()>(num_threads);
}

// Statistic rows in the caller's column order, for one call described by one array of int64
// (one argument is the cheapest call ctypes makes):
//   call[0] n inputs, call[1] width (columns), call[2] threads, call[3] min_share,
//   call[4] the address of the output (n * width float64, row by row),
//   call[5] the zero threshold's float64 bits,
//   call[6 .. 6 + width) the columns, then n triples (address of the first element, element
//   count > 0, 1 for float64, 0 for float32, 2 for float32 whose sums are accumulated in float64).
// A tensor's fields are [norm, min, max, sum, count(|x| < threshold), count(NaN), count(Inf)];
// column j is field c % 8 of c = columns[j], divided by the tensor's element count where
// c >= 8 (the mean from the sum, the zero fraction from the count). Up to `threads` threads
// (at most 64) read the inputs, each given at least `min_share` elements. Returns 0, or an
// error code (msmon.native says which).
int msmon_stats_rows(const void* packed) {
  try {
    int64_t head[6];  // copied out: the caller's buffer (Python bytes) need not be 8-byte aligned
    std::memcpy(head, packed, sizeof head);
    const int64_t n = head[0], width = head[1], threads = head[2], min_share = head[3];
    double* out = reinterpret_cast<double*>(static_cast<intptr_t>(head[4]));
    double threshold;
    std::memcpy(&threshold, &head[5], sizeof threshold);
    if (n < 0 || width < 0 || (out == nullptr && n * width > 0)) {
      return 4;
    }
    std::vector<int64_t> call(static_cast<size_t>(width + 3 * n));
    std::memcpy(call.data(), static_cast<const char*>(packed) + sizeof head, call.size() * sizeof(int64_t));
    const int64_t* columns = call.data();
    const int64_t* inputs = columns + width;
    for (int64_t j = 0; j < width; ++j) {
      if ((columns[j] & 7) >= kFields || (columns[j] & ~int64_t{8 + 7}) != 0) {
        return 2;
      }
    }
    std::vector<Input> in;
    in.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t numel = inputs[3 * i + 1], type = inputs[3 * i + 2];
      if (numel <= 0 || type < 0 || type > 2 || inputs[3 * i] == 0) {
        return 3;
      }
      in.push_back(Input{reinterpret_cast<const void*>(static_cast<intptr_t>(inputs[3 * i])), numel, type});
    }
    std::vector<double> fields(in.size() * kFields);
    fill(in, threshold, static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, 64))), min_share,
         fields.data());
    for (size_t i = 0; i < in.size(); ++i) {
      const double count = static_cast<double>(in[i].numel);
      for (int64_t j = 0; j < width; ++j) {
        const double v = fields[i * kFields + (columns[j] & 7)];
        out[i * width + j] = (columns[j] & 8) ? v / count : v;
      }
    }
    return 0;
  } catch (...) {  // no exception may cross the C ABI: out of memory, no thread to start
    return 1;
  }
}

// Which instruction set the reading loop runs with on this CPU (logged at build, shown by
// `msmon build-native`, recorded by the benchmarks).
const char* msmon_stats_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return "avx2";
  }
#endif
  return "baseline";
}

// The CSV sink's rounding of a step's values (msmon.sinks.numbers.csv_flat, whose docstring
// gives the rule and why it is exact): out[i] = round(v * 10^k) / 10^k in float64, k decimals
// (ndigits; for 0 < |v| < 1, k = max(ndigits, 1) - 1 - e, e the decimal exponent of |v| found
// in `decades`, the ascending 10^-323 ... 10^0 that csv_flat searches too). The same float64
// operations as csv_flat's torch path, so the same doubles; values where that quotient may
// differ from Python's own rounding (a near tie, a power of ten that is not exact, a product
// too large to round, a misjudged first digit) are left to the caller: their indices go to
// `doubtful`, and out[i] = v. Zero, NaN and infinities are out[i] = v, as round() gives.
// Here rather than in torch ops because the writer thread would otherwise touch some twenty
// torch kernels' code only for this, about 1.2 MiB of the process's resident memory
// (docs/performance.md). Returns the number of doubtful indices written.
int64_t msmon_csv_round(const double* in, double* out, int64_t n, int64_t ndigits, const double* decades,
                        int64_t* doubtful) {
  constexpr int kLowest = 323;  // decades[0] is 10^-kLowest, decades[kLowest] is 1
  constexpr int kExactPowers = 22;  // 10^k is exact in float64 up to here
  double pow10[kExactPowers + 1];
  pow10[0] = 1.0;
  for (int k = 1; k <= kExactPowers; ++k) {
    pow10[k] = pow10[k - 1] * 10.0;  // exact: every 10^k up to 10^22 is a float64
  }
  const int64_t digits = std::max<int64_t>(ndigits, 1);
  // the first digit is checked for 0 < |v| < 1 only, whose decimals are at least `digits`: past
  // kExactPowers such a value is doubtful before the check, so the clamp never changes a result
  const double lowest_kept = pow10[std::min<int64_t>(digits - 1, kExactPowers)];
  const double highest_kept = pow10[std::min<int64_t>(digits, kExactPowers)];
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = in[i];
    const double magnitude = std::fabs(v);
    out[i] = v;
    if (v == 0.0 || !(magnitude < std::numeric_limits<double>::infinity())) {
      continue;  // zero, NaN, infinities: round() returns them as they are
    }
    const bool small = magnitude < 1.0;
    double decimals = static_cast<double>(ndigits);
    if (small) {  // csv_flat: bucketize(|v|, decades, right=True) - (kLowest + 1)
      const int64_t index = std::upper_bound(decades, decades + kLowest + 1, magnitude) - decades;
      decimals = static_cast<double>(digits - 1) - static_cast<double>(index - (kLowest + 1));
    }
    if (!(decimals >= 0.0 && decimals <= kExactPowers)) {
      doubtful[count++] = i;
      continue;
    }
    const double scale = pow10[static_cast<int>(decimals)];
    const double scaled = v * scale;
    const double kept = std::nearbyint(scaled);  // ties to even, like torch.round
    const double size = std::fabs(scaled);
    const bool near_tie = std::fabs(scaled - std::floor(scaled) - 0.5) <= size * 0x1p-48;
    const bool first_digit_wrong = small && (std::fabs(kept) < lowest_kept || std::fabs(kept) > highest_kept);
    if (near_tie || !(size < 0x1p52) || first_digit_wrong) {
      doubtful[count++] = i;
      continue;
    }
    out[i] = kept / scale;
  }
  return count;
}

}  // extern "C"

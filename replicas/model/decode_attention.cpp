// Strata's attention on a CPU: query rows of one sequence (a decode step, a draft token
// attending alone, or a prefill chunk, after cached keys or not) against its keys, read in place
// from a KV cache of values through the row indices attention._GroupReads computes. It does what
// one fused SDPA call does for such a group (attention._attend), without gathering the keys into
// a tensor first and without SDPA's set-up, which at one query is most of its time.
//
// Per query row and head, in float32 whatever the cache dtype, scores in base 2:
//
//   s_j = (q * log2(e) / sqrt(D)) . k_j      for each key j the row sees (a value it does not
//   m = max_j s_j,  p_j = 2^(s_j - m)         see is never read: padding may hold anything)
//   out = (sum_j p_j v_j) / (sum_j p_j)
//
// A row that sees more than kSplitKeys keys takes them in splits of that many (counted from its
// first key seen), each as above but left undivided, in parallel; its output then combines the
// splits' maxima m_k, weights' sums l_k and sums o_k in split order: with M = max_k m_k and
// c_k = 2^(m_k - M), out = (sum_k c_k o_k) / (sum_k c_k l_k).
//
// A score is the product of column 0, then each next column's added in one fused multiply-add,
// in column order (16 keys at once, from a panel of the keys transposed); the weights' sum adds
// one key at a time in key order, and each column of the weighted sum of the values one fused
// multiply-add per key in key order; 2^x is a degree-7 polynomial on [-1/2, 1/2] times a power
// of two (relative error under 1e-8 before rounding). Every float step is the same on each
// instruction path (AVX-512: one register of 16 lanes; AVX2: two of 8; plain C++: an array of
// 16 and std::fma; the library is compiled with -ffp-contract=off, so nothing else is fused),
// and a row's result depends on nothing but the row and the keys it sees, in order: bitwise
// the same on every path, in any batch, however the keys are padded or masked, and whether the
// position is computed in a prefill, in a chunk after cached keys or as a decode. So prefix
// caching on and off give the same bits.
//
// The work is laid out for the memory it reads: a block of query rows transposes the keys it
// sees once, and its rows run in tiles of (row, head) pairs, so that each key column and value
// loaded serves a whole tile, where one row at a time would read every value once per row. A
// tile interleaves its pairs' steps and changes none of them.

#include "decode_attention.h"
#include "attention_kernel.h"
#include "native_isa.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <memory>
#include <vector>

namespace strata_native {
namespace {

using Kernel = void (*)(const Problem&, int64_t, int64_t);

template <typename T>
__attribute__((target("avx512f"), flatten)) void attend_avx512(const Problem& pr, int64_t b, int64_t e) {
  attend<Avx512, T>(pr, b, e);
}

template <typename T>
__attribute__((target("avx2,fma,f16c"), flatten)) void attend_avx2(const Problem& pr, int64_t b, int64_t e) {
  attend<Avx2, T>(pr, b, e);
}

template <typename T>
__attribute__((flatten)) void attend_generic(const Problem& pr, int64_t b, int64_t e) {
  attend<Generic, T>(pr, b, e);
}

__attribute__((target("avx512f"), flatten)) void combine_avx512(const Problem& pr, int64_t b, int64_t e) {
  combine<Avx512>(pr, b, e);
}

__attribute__((target("avx2,fma,f16c"), flatten)) void combine_avx2(const Problem& pr, int64_t b, int64_t e) {
  combine<Avx2>(pr, b, e);
}

__attribute__((flatten)) void combine_generic(const Problem& pr, int64_t b, int64_t e) {
  combine<Generic>(pr, b, e);
}

// The best path this CPU has, at most STRATA_NATIVE_ISA's (native_isa.h).
int64_t best_path() {
  static const int64_t path = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return kPathAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) return kPathAvx2;
    return kPathScalar;
  }();
  return std::min(isa_cap(), path);
}

template <typename T>
Kernel kernel_for(int64_t path) {
  switch (decode_attention_path(path)) {
    case kPathAvx512:
      return attend_avx512<T>;
    case kPathAvx2:
      return attend_avx2<T>;
    default:
      return attend_generic<T>;
  }
}

Kernel combiner_for(int64_t path) {
  switch (decode_attention_path(path)) {
    case kPathAvx512:
      return combine_avx512;
    case kPathAvx2:
      return combine_avx2;
    default:
      return combine_generic;
  }
}

// The kernel of `make` for a cache of cache_rows' dtype.
template <typename K, typename Make>
K for_cache(const at::Tensor& cache_rows, const char* name, Make make) {
  switch (cache_rows.scalar_type()) {
    case at::kFloat:
      return make(static_cast<float*>(nullptr));
    case at::kBFloat16:
      return make(static_cast<at::BFloat16*>(nullptr));
    case at::kHalf:
      return make(static_cast<at::Half*>(nullptr));
    default:
      TORCH_CHECK(false, name, ": a cache of ", cache_rows.scalar_type(),
                  " (float32, bfloat16 or float16 only)");
  }
  return K{};
}

// The checks both entry points make of their arguments; returns the keys' width W.
int64_t check_arguments(const char* name, const at::Tensor& q, const at::Tensor& cache_rows,
                        const at::Tensor& rows, int64_t num_seqs, int64_t num_kv_heads) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu(), name, ": q must be [rows, H, D] on a CPU");
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              name, ": ", num_heads, " heads do not share ", num_kv_heads, " kv heads");
  TORCH_CHECK(cache_rows.dim() == 2 && cache_rows.size(1) == head_dim && cache_rows.is_contiguous(),
              name, ": cache_rows must be contiguous [R, ", head_dim, "]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.numel() % std::max<int64_t>(2 * num_seqs * num_kv_heads, 1) == 0,
              name, ": rows must be contiguous int64 [2, S, kv heads, W]");
  TORCH_CHECK(head_dim % kLanes == 0, name, ": head_dim ", head_dim, " is not a multiple of ",
              kLanes);
  return rows.numel() / std::max<int64_t>(2 * num_seqs * num_kv_heads, 1);
}

// The queries [N, H, D] scaled by log2(e) / sqrt(D) in float32, rounded as
// at::mul(q.to(kFloat), scale) rounds them (the scale rounded to float, then one product per
// element), in one pass.
std::vector<float> scaled_queries(const at::Tensor& q) {
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const at::Tensor queries = q.stride(2) == 1 ? q : q.contiguous();
  const float scale = static_cast<float>(std::log2(M_E) / std::sqrt(double(head_dim)));
  std::vector<float> scaled(num_rows * num_heads * head_dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention_q", [&] {
    const scalar_t* data = queries.const_data_ptr<scalar_t>();
    for (int64_t s = 0; s < num_rows; ++s) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* row = data + s * queries.stride(0) + h * queries.stride(1);
        float* to = scaled.data() + (s * num_heads + h) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) to[i] = static_cast<float>(row[i]) * scale;
      }
    }
  });
  return scaled;
}

// out (float32) rounded to q's dtype (to nearest even, as out.to(q's dtype) rounds), in one pass.
at::Tensor in_dtype_of(const at::Tensor& out, const at::Tensor& q) {
  if (q.scalar_type() == at::kFloat) return out;
  at::Tensor rounded = at::empty(out.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention_out", [&] {
    const float* from = out.const_data_ptr<float>();
    scalar_t* to = rounded.mutable_data_ptr<scalar_t>();
    for (int64_t i = 0; i < out.numel(); ++i) to[i] = static_cast<scalar_t>(from[i]);
  });
  return rounded;
}

}  // namespace

int64_t decode_attention_path(int64_t requested) {
  return std::min(requested < 0 ? best_path() : requested, best_path());
}

namespace {

// Each row's first key and one past its last, in bounds[0 .. rows) and [rows .. 2 rows);
// between them, a mask may hide more. Returns whether one does for some row (has holes).
bool row_bounds(const char* name, const bool* seen, bool is_causal, int64_t q_len,
                int64_t num_rows, int64_t width, std::vector<int64_t>& bounds) {
  bounds.resize(2 * num_rows);
  bool has_holes = false;
  for (int64_t r = 0; r < num_rows; ++r) {
    int64_t lo = 0, hi = width;
    if (seen) {
      const bool* row = seen + r * width;
      while (lo < width && !row[lo]) ++lo;
      while (hi > lo && !row[hi - 1]) --hi;
      has_holes = has_holes || !std::all_of(row + lo, row + hi, [](bool b) { return b; });
    } else if (is_causal) {
      hi = std::min(width, width - q_len + r % q_len + 1);
    }
    TORCH_CHECK(hi > lo, name, ": query row ", r, " sees no key");
    bounds[r] = lo;
    bounds[num_rows + r] = hi;
  }
  return has_holes;
}

// Where each row's splits start (kSplitKeys of the keys it sees each; its last split's end
// last), [rows, splits + 1]; returns the most splits a row has.
int64_t split_points(const bool* seen, const int64_t* first, const int64_t* last,
                     int64_t num_rows, int64_t width, std::vector<int64_t>& at) {
  int64_t splits = 1;
  for (int64_t r = 0; r < num_rows; ++r) {
    int64_t count = last[r] - first[r];
    if (seen) count = std::count(seen + r * width + first[r], seen + r * width + last[r], true);
    splits = std::max(splits, (count + kSplitKeys - 1) / kSplitKeys);
  }
  at.assign(num_rows * (splits + 1), 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    int64_t* row_at = at.data() + r * (splits + 1);
    int64_t k = 0, count = 0;
    row_at[0] = first[r];
    for (int64_t j = first[r]; j < last[r] && splits > 1; ++j) {
      if (seen && !seen[r * width + j]) continue;
      if (count > 0 && count % kSplitKeys == 0) row_at[++k] = j;
      ++count;
    }
    std::fill(row_at + k + 1, row_at + splits + 1, last[r]);
  }
  return splits;
}

// The problem's tasks, a wave of units at a time: every split of a wave's units, then their
// rows' combination, with their partials in memory of at most wave_bytes (at least one unit's).
constexpr int64_t kWaveBytes = int64_t{32} << 20;

void run_waves(Problem& pr, Kernel kernel, Kernel combiner, int64_t work, int64_t wave_bytes) {
  const int64_t units = pr.num_seqs * pr.num_kv_heads * pr.num_blocks;
  // A task of `work` multiply-adds twice (a split's, a split's share): keep small ones together.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) * pr.splits / work);
  if (pr.splits == 1) {
    at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) { kernel(pr, begin, end); });
    return;
  }
  const int64_t rows_per_block = (pr.q_len + pr.num_blocks - 1) / pr.num_blocks;
  const int64_t unit_slots = rows_per_block * (pr.num_heads / pr.num_kv_heads) * pr.splits;
  const int64_t per_wave = std::clamp<int64_t>(
      wave_bytes / (unit_slots * (pr.head_dim + 2) * int64_t{sizeof(float)}), 1, units);
  // Not zeroed: combine reads only the slots of the splits a row has, which attend wrote.
  const std::unique_ptr<float[]> partials(new float[per_wave * unit_slots * (pr.head_dim + 2)]);
  pr.part_o = partials.get();
  pr.part_ml = partials.get() + per_wave * unit_slots * pr.head_dim;
  for (pr.unit0 = 0; pr.unit0 < units; pr.unit0 += per_wave) {
    const int64_t n = std::min(per_wave, units - pr.unit0);
    at::parallel_for(0, n * pr.splits, grain,
                     [&](int64_t begin, int64_t end) { kernel(pr, begin, end); });
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) { combiner(pr, begin, end); });
  }
}

// Both entry points: q_len query rows per sequence (see decode_attention.h).
at::Tensor attend_rows(const char* name, const at::Tensor& q, const at::Tensor& cache_rows,
                       const at::Tensor& rows, const std::optional<at::Tensor>& allowed,
                       bool is_causal, int64_t q_len, int64_t num_kv_heads, int64_t path,
                       int64_t wave_bytes) {
  TORCH_CHECK(q_len > 0 && q.dim() == 3 && q.size(0) % q_len == 0, name,
              ": q must be [S * q_len, H, D] for q_len ", q_len);
  const int64_t num_seqs = q.size(0) / q_len, num_rows = q.size(0);
  const int64_t width = check_arguments(name, q, cache_rows, rows, num_seqs, num_kv_heads);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const bool* seen = nullptr;
  if (allowed && allowed->defined()) {
    TORCH_CHECK(allowed->scalar_type() == at::kBool && allowed->is_contiguous() &&
                    allowed->numel() == num_rows * width,
                name, ": allowed must be contiguous bool [S, 1, q_len, W]");
    seen = allowed->const_data_ptr<bool>();
  }
  std::vector<int64_t> bounds, split_at;
  // A mask that hides only keys before a row's first or after its last (a chunk after cached
  // keys, a sliding window) says nothing the bounds do not: without it, rows tile.
  if (!row_bounds(name, seen, is_causal, q_len, num_rows, width, bounds)) seen = nullptr;
  const int64_t* first = bounds.data();
  const int64_t* last = first + num_rows;
  const int64_t splits = split_points(seen, first, last, num_rows, width, split_at);
  const std::vector<float> scaled = scaled_queries(q);
  at::Tensor out = at::empty({num_rows, num_heads, head_dim}, q.options().dtype(at::kFloat));
  // Blocks of query rows: a few per thread (each transposes the keys it sees once), and at
  // least two tasks per thread where the rows allow, so that a short chunk's few sequences and
  // kv heads (3 tasks for 2 threads) still share out evenly.
  const int64_t threads = at::get_num_threads();
  const int64_t num_blocks = std::min<int64_t>(
      std::max<int64_t>((q_len + kLanes - 1) / kLanes,
                        (2 * threads + num_seqs * num_kv_heads - 1) / (num_seqs * num_kv_heads)),
      std::min<int64_t>((q_len + 1) / 2, 4 * threads));
  Problem problem{scaled.data(), cache_rows.const_data_ptr(), rows.const_data_ptr<int64_t>(),
                  seen, out.mutable_data_ptr<float>(), num_seqs, q_len,
                  num_heads, num_kv_heads, head_dim, width, num_blocks, split_at.data(),
                  splits, 0, nullptr, nullptr};
  const Kernel kernel = for_cache<Kernel>(cache_rows, name, [&](auto* type) {
    return kernel_for<std::remove_pointer_t<decltype(type)>>(path);
  });
  // A unit is its rows x (H / kv heads) x W x D multiply-adds twice.
  const int64_t work = std::max<int64_t>(
      1, (q_len / num_blocks) * (num_heads / num_kv_heads) * width * head_dim);
  run_waves(problem, kernel, combiner_for(path), work, wave_bytes > 0 ? wave_bytes : kWaveBytes);
  return in_dtype_of(out, q);
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache_rows,
                            const at::Tensor& rows, const std::optional<at::Tensor>& allowed,
                            int64_t num_kv_heads, int64_t path) {
  RECORD_FUNCTION("strata_native::decode_attention", std::vector<c10::IValue>());
  return attend_rows("decode_attention", q, cache_rows, rows, allowed, false, 1, num_kv_heads,
                     path, -1);
}

at::Tensor rows_attention(const at::Tensor& q, const at::Tensor& cache_rows,
                          const at::Tensor& rows, const std::optional<at::Tensor>& allowed,
                          bool is_causal, int64_t q_len, int64_t num_kv_heads, int64_t path,
                          int64_t wave_bytes) {
  RECORD_FUNCTION("strata_native::rows_attention", std::vector<c10::IValue>());
  return attend_rows("rows_attention", q, cache_rows, rows, allowed, is_causal, q_len,
                     num_kv_heads, path, wave_bytes);
}

}  // namespace strata_native

// Strata's decode attention: one query per sequence (a decode step, or a draft token attending
// alone) against its keys, read in place from a KV cache of values through the row indices
// attention._GroupReads computes. It does what one fused SDPA call does for such a group
// (attention._attend), without gathering the keys into a tensor first and without SDPA's set-up,
// which at one query is most of its time: SmolLM2's 9 heads over 200 bfloat16 keys take SDPA
// and the gather about 60 us a layer on a Zen 4 core, this loop 25 (1,500 keys: 2,072 and 172).
//
// Per sequence and kv head, in float32 whatever the cache dtype, scores in base 2:
//
//   s_j = (q * log2(e) / sqrt(D)) . k_j      for each key j the sequence sees (masked keys are
//   m = max_j s_j,  p_j = 2^(s_j - m)         never read: padding may hold anything)
//   out = (sum_j p_j v_j) / (sum_j p_j)      keys in order, one multiply and one add at a time
//
// A dot product keeps 16 lanes (lane i sums the products of columns i, i + 16, ...) added
// pairwise at the end; 2^x is a degree-7 polynomial on [-1/2, 1/2] times a power of two
// (relative error under 1e-8 before rounding). Every float step is the same on each
// instruction path (AVX-512: one register of 16 lanes; AVX2: two of 8; plain C++: an array of
// 16; the library is compiled with -ffp-contract=off, so no path fuses a multiply-add), and a
// sequence's result depends on nothing but its own keys: bitwise the same on every path and in
// any batch, as prefix caching on and off needs.

#include "decode_attention.h"
#include "native_isa.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace strata_native {
namespace {

constexpr int64_t kLanes = 16;

// The entry points of the paths are flattened: every call below them is inlined into a function
// compiled for the path's instructions (always_inline would refuse a target-specific callee in a
// template that is not itself compiled for the target).
#define STRATA_AVX512 __attribute__((target("avx512f"))) inline
#define STRATA_AVX2 __attribute__((target("avx2,f16c"))) inline

// Lanes 0-7 added pairwise as sum_lanes does (see below).
STRATA_AVX2 float sum8(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// 16 float lanes on each path: one AVX-512 register, two AVX2 registers, or an array. Each
// operation is lane by lane, and sum_lanes adds the same pairs in the same order on every path.
struct Avx512 {
  struct V {
    __m512 a;
  };
  static STRATA_AVX512 V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static STRATA_AVX512 void store(float* p, V v) { _mm512_storeu_ps(p, v.a); }
  static STRATA_AVX512 V set1(float x) { return {_mm512_set1_ps(x)}; }
  static STRATA_AVX512 V add(V x, V y) { return {_mm512_add_ps(x.a, y.a)}; }
  static STRATA_AVX512 V sub(V x, V y) { return {_mm512_sub_ps(x.a, y.a)}; }
  static STRATA_AVX512 V mul(V x, V y) { return {_mm512_mul_ps(x.a, y.a)}; }
  static STRATA_AVX512 V max(V x, V y) { return {_mm512_max_ps(x.a, y.a)}; }
  // (trunc(x - 1/2), as float; 2^that) for -126 <= x <= 0 (the nearest integer n to x, 2^n)
  static STRATA_AVX512 void split(V x, V& n, V& power) {
    const __m512i i = _mm512_cvttps_epi32(_mm512_sub_ps(x.a, _mm512_set1_ps(0.5f)));
    n = {_mm512_cvtepi32_ps(i)};
    power = {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(127)), 23))};
  }
  static STRATA_AVX512 V load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static STRATA_AVX512 V load_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static STRATA_AVX512 float sum_lanes(V v) {
    const __m256 lo = _mm512_castps512_ps256(v.a);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.a), 1));
    return sum8(_mm256_add_ps(lo, hi));
  }
};

struct Avx2 {
  struct V {
    __m256 lo, hi;  // lanes 0-7, 8-15
  };
  static STRATA_AVX2 V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static STRATA_AVX2 void store(float* p, V v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
  }
  static STRATA_AVX2 V set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static STRATA_AVX2 V add(V x, V y) { return {_mm256_add_ps(x.lo, y.lo), _mm256_add_ps(x.hi, y.hi)}; }
  static STRATA_AVX2 V sub(V x, V y) { return {_mm256_sub_ps(x.lo, y.lo), _mm256_sub_ps(x.hi, y.hi)}; }
  static STRATA_AVX2 V mul(V x, V y) { return {_mm256_mul_ps(x.lo, y.lo), _mm256_mul_ps(x.hi, y.hi)}; }
  static STRATA_AVX2 V max(V x, V y) { return {_mm256_max_ps(x.lo, y.lo), _mm256_max_ps(x.hi, y.hi)}; }
  static STRATA_AVX2 void split_half(__m256 x, __m256& n, __m256& power) {
    const __m256i i = _mm256_cvttps_epi32(_mm256_sub_ps(x, _mm256_set1_ps(0.5f)));
    n = _mm256_cvtepi32_ps(i);
    power = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(127)), 23));
  }
  static STRATA_AVX2 void split(V x, V& n, V& power) {
    split_half(x.lo, n.lo, power.lo);
    split_half(x.hi, n.hi, power.hi);
  }
  static STRATA_AVX2 __m256 bf16_half(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static STRATA_AVX2 V load_bf16(const uint16_t* p) { return {bf16_half(p), bf16_half(p + 8)}; }
  static STRATA_AVX2 V load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static STRATA_AVX2 float sum_lanes(V v) { return sum8(_mm256_add_ps(v.lo, v.hi)); }
};

struct Generic {
  struct V {
    float a[kLanes];
  };
  template <typename F>
  static inline V map(F f) {
    V r;
    for (int64_t i = 0; i < kLanes; ++i) r.a[i] = f(i);
    return r;
  }
  static inline V load(const float* p) { return map([&](int64_t i) { return p[i]; }); }
  static inline void store(float* p, V v) { std::memcpy(p, v.a, sizeof(v.a)); }
  static inline V set1(float x) { return map([&](int64_t) { return x; }); }
  static inline V add(V x, V y) { return map([&](int64_t i) { return x.a[i] + y.a[i]; }); }
  static inline V sub(V x, V y) { return map([&](int64_t i) { return x.a[i] - y.a[i]; }); }
  static inline V mul(V x, V y) { return map([&](int64_t i) { return x.a[i] * y.a[i]; }); }
  static inline V max(V x, V y) {
    return map([&](int64_t i) { return x.a[i] > y.a[i] ? x.a[i] : y.a[i]; });  // maxps: NaN -> y
  }
  static inline void split(V x, V& n, V& power) {
    for (int64_t i = 0; i < kLanes; ++i) {
      const int32_t k = static_cast<int32_t>(x.a[i] - 0.5f);
      n.a[i] = static_cast<float>(k);
      const uint32_t bits = static_cast<uint32_t>(k + 127) << 23;
      std::memcpy(&power.a[i], &bits, sizeof(bits));
    }
  }
  static inline V load_bf16(const uint16_t* p) {
    V r;
    for (int64_t i = 0; i < kLanes; ++i) {
      const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      std::memcpy(&r.a[i], &bits, sizeof(bits));
    }
    return r;
  }
  static inline V load_f16(const uint16_t* p) {
    return map([&](int64_t i) { return static_cast<float>(c10::Half(p[i], c10::Half::from_bits())); });
  }
  static inline float sum_lanes(V v) {
    float* a = v.a;
    for (int64_t half = kLanes / 2; half >= 1; half /= 2) {
      for (int64_t i = 0; i < half; ++i) a[i] = a[i] + a[i + half];
    }
    return a[0];
  }
};

// 2^x for x <= 0 (below -126 taken as -126: 2^-126 beside the maximum's 1 is nothing).
template <typename P>
inline typename P::V exp2_nonpositive(typename P::V x) {
  x = P::max(x, P::set1(-126.0f));
  typename P::V n, power;
  P::split(x, n, power);
  const typename P::V f = P::sub(x, n);  // in [-1/2, 1/2]
  // 2^f = e^(f ln 2): Taylor coefficients (ln 2)^k / k!, k = 7 down to 1.
  typename P::V p = P::set1(1.525273380405984e-05f);
  for (const float c : {1.5403530393381606e-04f, 1.3333558146428443e-03f, 9.618129107628477e-03f,
                        5.550410866482158e-02f, 2.402265069591007e-01f, 6.931471805599453e-01f,
                        1.0f}) {
    p = P::add(P::mul(p, f), P::set1(c));
  }
  return P::mul(p, power);
}

// 16 values of a cache row from `p` as float32.
template <typename P>
inline typename P::V load_row(const float* p) {
  return P::load(p);
}

template <typename P>
inline typename P::V load_row(const at::BFloat16* p) {
  return P::load_bf16(reinterpret_cast<const uint16_t*>(p));
}

template <typename P>
inline typename P::V load_row(const at::Half* p) {
  return P::load_f16(reinterpret_cast<const uint16_t*>(p));
}

struct Problem {
  const float* q;  // [S, H, D], scaled by log2(e) / sqrt(D)
  const void* cache;
  const int64_t* rows;  // [2, S, kv heads, W]
  const bool* allowed;  // [S, W] or null
  float* out;           // [S, H, D]
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, width;
};

// Tasks [begin, end) of a problem, a task being one sequence and kv head. Each loop over the
// keys keeps its accumulator in a register: per query row, its scores; then per row and 16
// columns of the output, the weighted sum of the values.
template <typename P, typename T>
inline void attend(const Problem& pr, int64_t begin, int64_t end) {
  using V = typename P::V;
  const int64_t d = pr.head_dim, w = pr.width;
  const int64_t w_padded = (w + kLanes - 1) / kLanes * kLanes;
  const int64_t heads = pr.num_heads / pr.num_kv_heads;
  const T* cache = static_cast<const T*>(pr.cache);
  std::vector<float> scores(w_padded);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t s = task / pr.num_kv_heads, g = task % pr.num_kv_heads;
    const int64_t* keys = pr.rows + (s * pr.num_kv_heads + g) * w;
    const int64_t* values = keys + pr.num_seqs * pr.num_kv_heads * w;
    const bool* seen = pr.allowed ? pr.allowed + s * w : nullptr;
    for (int64_t h = g * heads; h < (g + 1) * heads; ++h) {
      const float* q = pr.q + (s * pr.num_heads + h) * d;
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < w_padded; ++j) {
        float score = -std::numeric_limits<float>::infinity();
        if (j < w && (!seen || seen[j])) {
          const T* key = cache + keys[j] * d;
          V dot = P::mul(P::load(q), load_row<P>(key));
          for (int64_t c = kLanes; c < d; c += kLanes) {
            dot = P::add(dot, P::mul(P::load(q + c), load_row<P>(key + c)));
          }
          score = P::sum_lanes(dot);
          max_score = std::max(max_score, score);
        }
        scores[j] = score;
      }
      const V m = P::set1(max_score);
      float sum = 0.0f;
      for (int64_t j = 0; j < w_padded; j += kLanes) {
        P::store(&scores[j], exp2_nonpositive<P>(P::sub(P::load(&scores[j]), m)));
        for (int64_t i = j; i < std::min(j + kLanes, w); ++i) {
          if (!seen || seen[i]) sum = sum + scores[i];
        }
      }
      float* out = pr.out + (s * pr.num_heads + h) * d;
      for (int64_t c = 0; c < d; c += kLanes) {
        V acc = P::set1(0.0f);
        for (int64_t j = 0; j < w; ++j) {
          if (seen && !seen[j]) continue;
          acc = P::add(acc, P::mul(P::set1(scores[j]), load_row<P>(cache + values[j] * d + c)));
        }
        P::store(out + c, acc);
        for (int64_t i = c; i < c + kLanes; ++i) out[i] = out[i] / sum;
      }
    }
  }
}

using Kernel = void (*)(const Problem&, int64_t, int64_t);

template <typename T>
__attribute__((target("avx512f"), flatten)) void attend_avx512(const Problem& pr, int64_t b, int64_t e) {
  attend<Avx512, T>(pr, b, e);
}

template <typename T>
__attribute__((target("avx2,f16c"), flatten)) void attend_avx2(const Problem& pr, int64_t b, int64_t e) {
  attend<Avx2, T>(pr, b, e);
}

template <typename T>
__attribute__((flatten)) void attend_generic(const Problem& pr, int64_t b, int64_t e) {
  attend<Generic, T>(pr, b, e);
}

// The best path this CPU has, at most STRATA_NATIVE_ISA's (native_isa.h).
int64_t best_path() {
  static const int64_t path = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return kPathAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return kPathAvx2;
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

}  // namespace

int64_t decode_attention_path(int64_t requested) {
  return std::min(requested < 0 ? best_path() : requested, best_path());
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache_rows,
                            const at::Tensor& rows, const std::optional<at::Tensor>& allowed,
                            int64_t num_kv_heads, int64_t path) {
  RECORD_FUNCTION("strata_native::decode_attention", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu(), "decode_attention: q must be [S, H, D] on a CPU");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_attention: ", num_heads, " heads do not share ", num_kv_heads, " kv heads");
  TORCH_CHECK(cache_rows.dim() == 2 && cache_rows.size(1) == head_dim && cache_rows.is_contiguous(),
              "decode_attention: cache_rows must be contiguous [R, ", head_dim, "]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  rows.numel() % (2 * num_seqs * num_kv_heads) == 0,
              "decode_attention: rows must be contiguous int64 [2, S, kv heads, W]");
  const int64_t width = rows.numel() / std::max<int64_t>(2 * num_seqs * num_kv_heads, 1);
  const bool* seen = nullptr;
  if (allowed && allowed->defined()) {
    TORCH_CHECK(allowed->scalar_type() == at::kBool && allowed->is_contiguous() &&
                    allowed->numel() == num_seqs * width,
                "decode_attention: allowed must be contiguous bool [S, 1, 1, W]");
    seen = allowed->const_data_ptr<bool>();
  }
  TORCH_CHECK(head_dim % kLanes == 0, "decode_attention: head_dim ", head_dim,
              " is not a multiple of ", kLanes);
  const at::Tensor queries = q.stride(2) == 1 ? q : q.contiguous();
  // The queries scaled by log2(e) / sqrt(D) in float32, rounded as at::mul(q.to(kFloat), scale)
  // rounds them (the scale rounded to float, then one product per element), in one pass.
  const float scale = static_cast<float>(std::log2(M_E) / std::sqrt(double(head_dim)));
  std::vector<float> scaled(num_seqs * num_heads * head_dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_q", [&] {
    const scalar_t* data = queries.const_data_ptr<scalar_t>();
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const scalar_t* row = data + s * queries.stride(0) + h * queries.stride(1);
        float* to = scaled.data() + (s * num_heads + h) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) to[i] = static_cast<float>(row[i]) * scale;
      }
    }
  });
  const bool is_float = q.scalar_type() == at::kFloat;
  at::Tensor out = at::empty({num_seqs, num_heads, head_dim}, q.options().dtype(at::kFloat));
  Problem problem{scaled.data(), cache_rows.const_data_ptr(),
                  rows.const_data_ptr<int64_t>(), seen, out.mutable_data_ptr<float>(),
                  num_seqs, num_heads, num_kv_heads, head_dim, width};
  Kernel kernel = nullptr;
  switch (cache_rows.scalar_type()) {
    case at::kFloat:
      kernel = kernel_for<float>(path);
      break;
    case at::kBFloat16:
      kernel = kernel_for<at::BFloat16>(path);
      break;
    case at::kHalf:
      kernel = kernel_for<at::Half>(path);
      break;
    default:
      TORCH_CHECK(false, "decode_attention: a cache of ", cache_rows.scalar_type(),
                  " (float32, bfloat16 or float16 only)");
  }
  const int64_t tasks = num_seqs * num_kv_heads;
  // A task is (H / kv heads) x W x D multiply-adds twice: keep small ones on one thread.
  const int64_t work = std::max<int64_t>(1, (num_heads / num_kv_heads) * width * head_dim);
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / work);
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) { kernel(problem, begin, end); });
  if (is_float) return out;
  // Rounded to q's dtype (to nearest even, as out.to(q's dtype) rounds), in one pass.
  at::Tensor rounded = at::empty(out.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_out", [&] {
    const float* from = out.const_data_ptr<float>();
    scalar_t* to = rounded.mutable_data_ptr<scalar_t>();
    for (int64_t i = 0; i < out.numel(); ++i) to[i] = static_cast<scalar_t>(from[i]);
  });
  return rounded;
}

}  // namespace strata_native

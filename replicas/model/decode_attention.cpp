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

constexpr int64_t kLanes = 16;

// The entry points of the paths are flattened: every call below them is inlined into a function
// compiled for the path's instructions (always_inline would refuse a target-specific callee in a
// template that is not itself compiled for the target).
#define STRATA_AVX512 __attribute__((target("avx512f"))) inline
#define STRATA_AVX2 __attribute__((target("avx2,fma,f16c"))) inline

// 16 float lanes on each path: one AVX-512 register, two AVX2 registers, or an array. Each
// operation is lane by lane, with the same rounding on every path.
struct Avx512 {
  struct V {
    __m512 a;
  };
  static constexpr int kValueChunks = 4;  // value columns summed at once, by kLanes
  static constexpr int kScoreGroups = 2;  // groups of kLanes keys scored at once
  static constexpr int kPairs = 6;        // (query row, head) pairs at once (values: 24 sums)
  static STRATA_AVX512 V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static STRATA_AVX512 void store(float* p, V v) { _mm512_storeu_ps(p, v.a); }
  static STRATA_AVX512 V set1(float x) { return {_mm512_set1_ps(x)}; }
  static STRATA_AVX512 V add(V x, V y) { return {_mm512_add_ps(x.a, y.a)}; }
  static STRATA_AVX512 V sub(V x, V y) { return {_mm512_sub_ps(x.a, y.a)}; }
  static STRATA_AVX512 V mul(V x, V y) { return {_mm512_mul_ps(x.a, y.a)}; }
  static STRATA_AVX512 V max(V x, V y) { return {_mm512_max_ps(x.a, y.a)}; }
  static STRATA_AVX512 V fma(V x, V y, V z) { return {_mm512_fmadd_ps(x.a, y.a, z.a)}; }
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
  // dst[c * 16 + i] = src[i * 16 + c]: 16 rows of 16 floats transposed.
  static STRATA_AVX512 void transpose16(const float* src, float* dst) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + 16 * i);
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int b = 0; b < 16; b += 4) {  // r[b + k]: column 4L + k of rows b .. b + 3, lane L
      const __m512d t0 = _mm512_castps_pd(t[b]), t1 = _mm512_castps_pd(t[b + 1]);
      const __m512d t2 = _mm512_castps_pd(t[b + 2]), t3 = _mm512_castps_pd(t[b + 3]);
      r[b] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
      r[b + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
      r[b + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
      r[b + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    for (int k = 0; k < 4; ++k) {
      const __m512 v = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
      const __m512 w = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
      const __m512 v1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
      const __m512 w1 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
      _mm512_storeu_ps(dst + 16 * k, _mm512_shuffle_f32x4(v, w, 0x88));
      _mm512_storeu_ps(dst + 16 * (8 + k), _mm512_shuffle_f32x4(v, w, 0xdd));
      _mm512_storeu_ps(dst + 16 * (4 + k), _mm512_shuffle_f32x4(v1, w1, 0x88));
      _mm512_storeu_ps(dst + 16 * (12 + k), _mm512_shuffle_f32x4(v1, w1, 0xdd));
    }
  }
};

struct Avx2 {
  struct V {
    __m256 lo, hi;  // lanes 0-7, 8-15
  };
  static constexpr int kValueChunks = 1;
  static constexpr int kScoreGroups = 1;
  static constexpr int kPairs = 6;  // 12 of the 16 registers hold sums, 3 a key or value row
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
  static STRATA_AVX2 V fma(V x, V y, V z) {
    return {_mm256_fmadd_ps(x.lo, y.lo, z.lo), _mm256_fmadd_ps(x.hi, y.hi, z.hi)};
  }
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
  // dst[c * 16 + i] = src[i * 16 + c]: 16 rows of 16 floats transposed, 8 by 8.
  static STRATA_AVX2 void transpose16(const float* src, float* dst) {
    for (int rb = 0; rb < 16; rb += 8) {
      for (int cb = 0; cb < 16; cb += 8) {
        __m256 a[8], t[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(src + 16 * (rb + i) + cb);
        for (int i = 0; i < 8; i += 2) {
          t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
          t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
        }
        for (int b = 0; b < 8; b += 4) {  // a[b + k]: column 4L + k of rows b .. b + 3, lane L
          a[b] = _mm256_shuffle_ps(t[b], t[b + 2], 0x44);
          a[b + 1] = _mm256_shuffle_ps(t[b], t[b + 2], 0xEE);
          a[b + 2] = _mm256_shuffle_ps(t[b + 1], t[b + 3], 0x44);
          a[b + 3] = _mm256_shuffle_ps(t[b + 1], t[b + 3], 0xEE);
        }
        for (int k = 0; k < 4; ++k) {
          _mm256_storeu_ps(dst + 16 * (cb + k) + rb, _mm256_permute2f128_ps(a[k], a[4 + k], 0x20));
          _mm256_storeu_ps(dst + 16 * (cb + 4 + k) + rb,
                           _mm256_permute2f128_ps(a[k], a[4 + k], 0x31));
        }
      }
    }
  }
};

struct Generic {
  struct V {
    float a[kLanes];
  };
  static constexpr int kValueChunks = 1;
  static constexpr int kScoreGroups = 1;
  static constexpr int kPairs = 4;
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
  }  static inline V fma(V x, V y, V z) {
    return map([&](int64_t i) { return std::fma(x.a[i], y.a[i], z.a[i]); });
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
  // dst[c * 16 + i] = src[i * 16 + c]: 16 rows of 16 floats transposed.
  static inline void transpose16(const float* src, float* dst) {
    for (int64_t i = 0; i < kLanes; ++i) {
      for (int64_t c = 0; c < kLanes; ++c) dst[c * kLanes + i] = src[i * kLanes + c];
    }
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

// Asks for the cache lines of `bytes` bytes from `p` before they are loaded. A block cache's
// rows of one kv head are scattered (among the other heads' rows, in blocks anywhere in the
// pool), so a long context's loads otherwise wait on memory one row at a time.
template <typename T>
inline void fetch_ahead(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}
constexpr int64_t kValuesAhead = 8;  // value rows fetched this many keys ahead

// A row that sees more keys than this attends over each run of this many it sees (from its
// first), in parallel, and then combines the runs' partials (combine): so a long context's few
// sequences and kv heads (a chunk, a decode) still keep every thread busy. Where the splits
// fall depends on nothing but the keys the row sees, so a row's bits stay its own.
constexpr int64_t kSplitKeys = 512;

struct Problem {
  const float* q;        // [S * L, H, D], scaled by log2(e) / sqrt(D)
  const void* cache;
  const int64_t* rows;   // [2, S, kv heads, W]
  const bool* allowed;   // [S * L, W] or null
  float* out;            // [S * L, H, D]
  int64_t num_seqs, q_len, num_heads, num_kv_heads, head_dim, width, num_blocks;
  // Splits (see kSplitKeys): row r's split k is keys [at[k], at[k + 1]) for at = split_at +
  // r * (splits + 1); a row of fewer splits ends in empty ones. A row of more than one writes
  // each split's partial (its maximum, sum of weights and unnormalized sums of the values) to
  // the slots of its task's unit, numbered from unit0, for combine() to finish.
  const int64_t* split_at;
  int64_t splits, unit0;
  float* part_ml;  // [units, rows per block, heads per kv head, splits, 2]: maximum, sum
  float* part_o;   // [units, rows per block, heads per kv head, splits, D]
};

// Up to kHeads query heads of one kv head run together: they see the same keys, so each key
// (and value) loaded serves them all. So do up to P::kPairs / heads query rows of a sequence
// that see the same first key and no mask (a prefill or a chunk after cached keys): a tile of
// (row, head) pairs reads each key and value once for all of them, where one row at a time
// would read them once per row.
constexpr int kHeads = 4;

// Scores of NH (row, head) pairs for NG groups of kLanes keys from `panel` (transposed keys:
// [group, D, kLanes]): per key, the product of column 0, then each next column's added in one
// fused multiply-add, in column order. scores[i] is pair i's, indexed by group * kLanes.
template <typename P, int NG, int NH>
inline void score_groups(const float* const* q, const float* panel, int64_t d, int64_t group,
                         float* const* scores) {
  using V = typename P::V;
  V acc[NH][NG];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
    const V q0 = P::set1(q[h][0]);
#pragma GCC unroll 2
    for (int i = 0; i < NG; ++i) acc[h][i] = P::mul(q0, P::load(panel + i * d * kLanes));
  }
  for (int64_t c = 1; c < d; ++c) {
    V k[NG];
#pragma GCC unroll 2
    for (int i = 0; i < NG; ++i) k[i] = P::load(panel + (i * d + c) * kLanes);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const V qc = P::set1(q[h][c]);
#pragma GCC unroll 2
      for (int i = 0; i < NG; ++i) acc[h][i] = P::fma(qc, k[i], acc[h][i]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 2
    for (int i = 0; i < NG; ++i) P::store(scores[h] + (group + i) * kLanes, acc[h][i]);
  }
}

// Columns [c0, c0 + NC * kLanes) of NH pairs' weighted sums of the values of keys [first, last)
// (those `seen` hides skipped), in key order, one fused multiply-add each: weights[h][j] is
// key j's weight for pair h. The sums start at 0, or with `resume` at what out holds (the sums
// over the keys before `first`, which a tile's last rows go on from).
template <typename P, typename T, int NC, int NH>
inline void weigh_values(const float* const* weights, const T* cache, const int64_t* values,
                         const bool* seen, int64_t first, int64_t last, int64_t d, int64_t c0,
                         float* const* out, bool resume) {
  using V = typename P::V;
  V acc[NH][NC];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 4
    for (int i = 0; i < NC; ++i) {
      acc[h][i] = resume ? P::load(out[h] + c0 + i * kLanes) : P::set1(0.0f);
    }
  }
  for (int64_t j = first; j < last; ++j) {
    if (j + kValuesAhead < last) {
      fetch_ahead(cache + values[j + kValuesAhead] * d + c0, NC * kLanes * sizeof(T));
    }
    if (seen && !seen[j]) continue;
    const T* value = cache + values[j] * d + c0;
    V v[NC];
#pragma GCC unroll 4
    for (int i = 0; i < NC; ++i) v[i] = load_row<P>(value + i * kLanes);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const V weight = P::set1(weights[h][j]);
#pragma GCC unroll 4
      for (int i = 0; i < NC; ++i) acc[h][i] = P::fma(weight, v[i], acc[h][i]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 4
    for (int i = 0; i < NC; ++i) P::store(out[h] + c0 + i * kLanes, acc[h][i]);
  }
}

// The keys one query row sees: [first, last) of its sequence's, less those `seen` hides;
// its scores fill whole groups of kLanes keys, groups [g0, g1) from the panel's first.
struct RowKeys {
  int64_t first, last, origin, g0, g1;
  const bool* seen;
};

// A row's weights from its scores (indexed from the panel's first key, kLanes per group):
// 2^(s - max), exactly 0 for a key it does not see.
template <typename P>
inline float softmax_weights(float* scores, const RowKeys& k) {
  using V = typename P::V;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float* at = scores - k.origin;  // at[j]: key j's
  const int64_t from = k.origin + k.g0 * kLanes, to = k.origin + k.g1 * kLanes;
  auto hide = [&](float value) {
    for (int64_t j = from; j < k.first; ++j) at[j] = value;
    for (int64_t j = k.last; j < to; ++j) at[j] = value;
    if (k.seen) {
      for (int64_t j = k.first; j < k.last; ++j) {
        if (!k.seen[j]) at[j] = value;
      }
    }
  };
  hide(minus_inf);
  V maxima = P::set1(minus_inf);
  for (int64_t g = k.g0; g < k.g1; ++g) maxima = P::max(maxima, P::load(scores + g * kLanes));
  float lanes[kLanes];
  P::store(lanes, maxima);
  float max_score = minus_inf;
  for (const float x : lanes) max_score = std::max(max_score, x);
  const V m = P::set1(max_score);
  for (int64_t g = k.g0; g < k.g1; ++g) {
    P::store(scores + g * kLanes, exp2_nonpositive<P>(P::sub(P::load(scores + g * kLanes), m)));
  }
  hide(0.0f);
  return max_score;
}

// Columns [c0, c0 + NC * kLanes) of NP pairs' weighted sums of the values: over the keys
// [first, common) all of them see at once, then each pair's on over the rest of its own.
template <typename P, typename T, int NC, int NP>
inline void weigh_tile(const float* const* weights, const T* cache, const int64_t* values,
                       const RowKeys* const* k, int64_t first, int64_t common, int64_t d,
                       int64_t c0, float* const* out) {
  const bool* seen = k[0]->seen;
  weigh_values<P, T, NC, NP>(weights, cache, values, seen, first, common, d, c0, out, false);
  for (int p = 0; p < NP; ++p) {
    if (k[p]->last > common) {
      weigh_values<P, T, NC, 1>(&weights[p], cache, values, seen, common, k[p]->last, d, c0,
                                &out[p], true);
    }
  }
}

// NP (row, head) pairs of rows that see the same first key and, when a mask hides keys, of one
// row: q[p] its scaled query, k[p] the keys its row sees, scores[p] room for its scores, out[p]
// its output row. Every step of a pair is the one it takes alone: its scores cover groups
// [g0, g1) of its own keys (the tile scores the groups of all, the others unused), its weights
// and their sum run over its own keys in key order, and its values' sum goes over the keys all
// the tile's rows see, then on (resumed) over the rest of its own. A pair with partial[p] (one
// split of a row's keys) leaves its sums undivided there, with its maximum and weights' sum.
template <typename P, typename T, int NP>
inline void attend_pairs(const float* const* q, const float* panel, const T* cache,
                         const int64_t* values, const RowKeys* const* k, int64_t d,
                         float* const* scores, float* const* out, float* const* partial) {
  const int64_t first = k[0]->first, g0 = k[0]->g0;
  int64_t g1 = k[0]->g1, common = k[0]->last;
  for (int p = 1; p < NP; ++p) {
    g1 = std::max(g1, k[p]->g1);
    common = std::min(common, k[p]->last);
  }
  constexpr int64_t groups = P::kScoreGroups;
  int64_t g = g0;
  for (; g + groups <= g1; g += groups) {
    score_groups<P, groups, NP>(q, panel + g * d * kLanes, d, g, scores);
  }
  for (; g < g1; ++g) score_groups<P, 1, NP>(q, panel + g * d * kLanes, d, g, scores);
  const float* weights[NP];
  float maxima[NP];
  for (int p = 0; p < NP; ++p) {
    maxima[p] = softmax_weights<P>(scores[p], *k[p]);
    weights[p] = scores[p] - k[p]->origin;
  }
  // Each pair's sum of its weights, one key at a time in key order (a hidden key's 0 changes
  // nothing): the same bits however the keys are laid out or padded.
  float sums[NP];
  for (int p = 0; p < NP; ++p) sums[p] = 0.0f;
  for (int64_t j = first; j < common; ++j) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) sums[p] = sums[p] + weights[p][j];
  }
  for (int p = 0; p < NP; ++p) {
    for (int64_t j = common; j < k[p]->last; ++j) sums[p] = sums[p] + weights[p][j];
  }
  constexpr int64_t chunks = P::kValueChunks;
  int64_t c0 = 0;
  for (; c0 + chunks * kLanes <= d; c0 += chunks * kLanes) {
    weigh_tile<P, T, chunks, NP>(weights, cache, values, k, first, common, d, c0, out);
  }
  for (; c0 < d; c0 += kLanes) {
    weigh_tile<P, T, 1, NP>(weights, cache, values, k, first, common, d, c0, out);
  }
  for (int p = 0; p < NP; ++p) {
    if (partial[p]) {
      partial[p][0] = maxima[p];
      partial[p][1] = sums[p];
      continue;
    }
    for (int64_t i = 0; i < d; ++i) out[p][i] = out[p][i] / sums[p];
  }
}

// attend_pairs for np pairs, 1 <= np <= NP_MAX.
template <typename P, typename T, int NP_MAX, int NP = 1>
inline void attend_tile(int np, const float* const* q, const float* panel, const T* cache,
                        const int64_t* values, const RowKeys* const* k, int64_t d,
                        float* const* scores, float* const* out, float* const* partial) {
  if constexpr (NP < NP_MAX) {
    if (np > NP) {
      attend_tile<P, T, NP_MAX, NP + 1>(np, q, panel, cache, values, k, d, scores, out, partial);
      return;
    }
  }
  attend_pairs<P, T, NP>(q, panel, cache, values, k, d, scores, out, partial);
}

// A unit of a problem: one sequence, kv head and block of query rows [row0, row1).
struct Unit {
  int64_t seq, kv_head, row0, row1;
};

inline Unit unit_of(const Problem& pr, int64_t unit) {
  // Blocks interleaved from both ends, so that threads share a causal prefill evenly.
  const int64_t b = unit % pr.num_blocks, rest = unit / pr.num_blocks;
  const int64_t block = b % 2 == 0 ? b / 2 : pr.num_blocks - 1 - b / 2;
  const int64_t rows_per_block = (pr.q_len + pr.num_blocks - 1) / pr.num_blocks;
  const int64_t s = rest / pr.num_kv_heads, row0 = s * pr.q_len + block * rows_per_block;
  return {s, rest % pr.num_kv_heads, row0,
          std::min(s * pr.q_len + pr.q_len, row0 + rows_per_block)};
}

inline const int64_t* split_of(const Problem& pr, int64_t row, int64_t k) {
  return pr.split_at + row * (pr.splits + 1) + k;  // [0]: its first key, [1]: one past its last
}

// The keys [lo, hi) that a unit's rows see in split k; false when none does.
inline bool split_span(const Problem& pr, const Unit& u, int64_t k, int64_t& lo, int64_t& hi) {
  lo = pr.width, hi = 0;
  for (int64_t r = u.row0; r < u.row1; ++r) {
    const int64_t* at = split_of(pr, r, k);
    if (at[0] < at[1]) lo = std::min(lo, at[0]), hi = std::max(hi, at[1]);
  }
  return lo < hi;
}

// The keys [lo, hi) transposed into `panel` ([key group, D, kLanes], groups from lo's), with
// the next group's rows asked for while one is transposed.
template <typename P, typename T>
inline void transpose_keys(const T* cache, const int64_t* keys, int64_t lo, int64_t hi,
                           int64_t d, std::vector<float>& panel) {
  using V = typename P::V;
  const int64_t origin = lo / kLanes * kLanes;
  const int64_t num_groups = (hi - origin + kLanes - 1) / kLanes;
  panel.resize(num_groups * d * kLanes);
  for (int64_t group = 0; group < num_groups; ++group) {
    const int64_t j0 = origin + group * kLanes;
    for (int64_t j = std::max(j0 + kLanes, lo); j < std::min(j0 + 2 * kLanes, hi); ++j) {
      fetch_ahead(cache + keys[j] * d, d * static_cast<int64_t>(sizeof(T)));  // the next group's
    }
    for (int64_t c = 0; c < d; c += kLanes) {  // 16 keys by 16 columns at a time
      float tile[kLanes * kLanes];
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t j = j0 + i;
        const V row = j >= lo && j < hi ? load_row<P>(cache + keys[j] * d + c) : P::set1(0.0f);
        P::store(tile + i * kLanes, row);
      }
      P::transpose16(tile, &panel[(group * d + c) * kLanes]);
    }
  }
}

// Tasks [begin, end) of a problem, a task being split k of one unit's rows (every row's own
// keys when no row is split). The keys the rows see in the split are transposed into a panel
// of kLanes keys by D columns, so that a query row's scores come kLanes keys at a time, one
// multiply-add per column; then, per tile of rows (attend_pairs), their softmax over kLanes
// keys at a time and the weighted sums of the values, kLanes columns at a time. Every step a
// row takes depends on nothing but the row and the keys it sees.
template <typename P, typename T>
inline void attend(const Problem& pr, int64_t begin, int64_t end_task) {
  const int64_t d = pr.head_dim, w = pr.width;
  const int64_t heads = pr.num_heads / pr.num_kv_heads;
  const int64_t rows_per_block = (pr.q_len + pr.num_blocks - 1) / pr.num_blocks;
  const T* cache = static_cast<const T*>(pr.cache);
  std::vector<float> panel;   // [key group, D, kLanes]: the split's keys, transposed
  constexpr int kMaxPairs = std::max(P::kPairs, kHeads);
  std::vector<float> scores;  // [kMaxPairs, groups * kLanes]: a tile's scores, then weights
  for (int64_t task = begin; task < end_task; ++task) {
    const int64_t k = task % pr.splits, unit = pr.unit0 + task / pr.splits;
    const Unit u = unit_of(pr, unit);
    const int64_t* keys = pr.rows + (u.seq * pr.num_kv_heads + u.kv_head) * w;
    const int64_t* values = keys + pr.num_seqs * pr.num_kv_heads * w;
    int64_t lo, hi;
    if (!split_span(pr, u, k, lo, hi)) continue;  // every row's keys end in an earlier split
    transpose_keys<P, T>(cache, keys, lo, hi, d, panel);
    const int64_t origin = lo / kLanes * kLanes, stride = panel.size() / d;
    scores.resize(kMaxPairs * stride);
    for (int64_t h0 = u.kv_head * heads; h0 < (u.kv_head + 1) * heads; h0 += kHeads) {
      const int nh = static_cast<int>(std::min<int64_t>(kHeads, (u.kv_head + 1) * heads - h0));
      const int64_t tile_rows = pr.allowed ? 1 : std::max(1, P::kPairs / nh);
      for (int64_t r0 = u.row0; r0 < u.row1;) {
        if (split_of(pr, r0, k)[0] >= split_of(pr, r0, k)[1]) {
          ++r0;
          continue;
        }
        RowKeys row_keys[kMaxPairs];
        const RowKeys* pair_keys[kMaxPairs];
        const float* q[kMaxPairs];
        float* score_rows[kMaxPairs];
        float* out[kMaxPairs];
        float* partial[kMaxPairs];
        int np = 0;
        int64_t r = r0;
        for (; r < u.row1 && r < r0 + tile_rows && split_of(pr, r, k)[0] == split_of(pr, r0, k)[0];
             ++r) {
          const int64_t* at = split_of(pr, r, k);
          RowKeys& keys_of_row = row_keys[r - r0];
          keys_of_row = {at[0], at[1], origin, (at[0] - origin) / kLanes,
                         (at[1] - origin + kLanes - 1) / kLanes,
                         pr.allowed ? pr.allowed + r * w : nullptr};
          const bool split = pr.splits > 1 && split_of(pr, r, 1)[0] < split_of(pr, r, 1)[1];
          for (int h = 0; h < nh; ++h, ++np) {
            const int64_t slot =
                (((unit - pr.unit0) * rows_per_block + r - u.row0) * heads + h0 + h -
                 u.kv_head * heads) * pr.splits + k;
            pair_keys[np] = &keys_of_row;
            q[np] = pr.q + (r * pr.num_heads + h0 + h) * d;
            score_rows[np] = scores.data() + np * stride;
            out[np] = split ? pr.part_o + slot * d : pr.out + (r * pr.num_heads + h0 + h) * d;
            partial[np] = split ? pr.part_ml + 2 * slot : nullptr;
          }
        }
        attend_tile<P, T, kMaxPairs>(np, q, panel.data(), cache, values, pair_keys, d,
                                     score_rows, out, partial);
        r0 = r;
      }
    }
  }
}

// Units [begin, end) of a problem's wave (numbered from unit0): each split row's output from
// its splits' partials, in split order: M the largest maximum, c_k = 2^(m_k - M), and
// out = (sum_k c_k o_k) / (sum_k c_k l_k), each sum one term at a time, a column's in one
// fused multiply-add per split.
template <typename P>
inline void combine(const Problem& pr, int64_t begin, int64_t end) {
  using V = typename P::V;
  const int64_t d = pr.head_dim, heads = pr.num_heads / pr.num_kv_heads;
  const int64_t rows_per_block = (pr.q_len + pr.num_blocks - 1) / pr.num_blocks;
  std::vector<float> scale(pr.splits);
  for (int64_t unit = pr.unit0 + begin; unit < pr.unit0 + end; ++unit) {
    const Unit u = unit_of(pr, unit);
    for (int64_t r = u.row0; r < u.row1; ++r) {
      int64_t n = 0;
      while (n < pr.splits && split_of(pr, r, n)[0] < split_of(pr, r, n)[1]) ++n;
      if (n < 2) continue;  // attended whole, out written
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t slot0 =
            (((unit - pr.unit0) * rows_per_block + r - u.row0) * heads + h) * pr.splits;
        const float* ml = pr.part_ml + 2 * slot0;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < n; ++k) top = std::max(top, ml[2 * k]);
        float sum = 0.0f;
        for (int64_t k = 0; k < n; ++k) {
          float lanes[kLanes];
          P::store(lanes, exp2_nonpositive<P>(P::set1(ml[2 * k] - top)));
          scale[k] = lanes[0];
          sum = sum + scale[k] * ml[2 * k + 1];
        }
        float* out = pr.out + (r * pr.num_heads + u.kv_head * heads + h) * d;
        for (int64_t c = 0; c < d; c += kLanes) {
          V acc = P::set1(0.0f);
          for (int64_t k = 0; k < n; ++k) {
            acc = P::fma(P::set1(scale[k]), P::load(pr.part_o + (slot0 + k) * d + c), acc);
          }
          P::store(out + c, acc);
        }
        for (int64_t i = 0; i < d; ++i) out[i] = out[i] / sum;
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

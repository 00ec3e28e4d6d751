// The 16 float lanes Strata's CPU attention computes in, on each instruction path, and the
// helpers every path shares (decode_attention.cpp, which includes this once).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

}  // namespace
}  // namespace strata_native

// Strata's quantized products: y = x W^T for a weight W kept as integer codes with float16 scales
// per output row and group of 32 input columns, against activations quantized on the fly to int8
// per group of 32, the schemes llama.cpp runs GGUF Q4_1 and Q8_0 with:
//
//   int4_mm: w = d * q + m, q in [0, 15] (or 31)     int8_mm: w = d * q, q in [-127, 127]
//
// The activations are quantized in one or two passes, the layer's choice (x ~ dx0 * qx0, or
// dx0 * qx0 + dx1 * qx1, per row and group, qx in [-127, 127]; QuantizedRows). A group's
// integer dot product sum(q * qx) is exact in int32 whatever the instructions (AVX-512 VNNI,
// AVX2, or plain C++), and the float steps that follow are the same for every path, row and
// batch:
//
//   acc += float(sum(q * qx0)) * (d * dx0);  acc += float(sum(q * qx1)) * (d * dx1) (two passes);
//   acc += m * sx  (int4 only; sx the float sum of the group's activations)
//
// group after group, in order. So a row's result is bitwise the same on every CPU path and
// whatever other rows share the call (the engine's outputs do not depend on batching, chunking or
// prefix caching). The library is compiled with -ffp-contract=off and the vector paths use
// separate multiplies and adds, as the scalar one does.
//
// Layouts (replicas/model/quant.py), both in tiles of 16 output rows, so that one 64-byte load
// holds 16 rows' codes for a few columns and one VNNI multiply-add (16 lanes of 4 bytes) takes them:
// - int4: one 64-byte chunk per 8 input columns: byte 4 c + r holds row c's column 8 o + r in its
//   low nibble and column 8 o + 4 + r in its high nibble ([N / 16, K / 8, 64] uint8); d and m per
//   tile and group as [N / 16, K / 32, 2, 16] float16, or, for a GGUF Q4_K weight, as its own
//   6-bit codes under a float16 pair per 8 groups ([N / 16, K / 256, 320] uint8: D[16] and
//   -Dmin[16] float16, then per group sc[16] and mn[16]; d = D sc and m = -Dmin mn, both exact
//   in float32): 4.625 bits a weight in all, against 5. 5-bit codes (q in [0, 31], a GGUF Q5_0,
//   Q5_1 or Q5_K weight's) add a fifth 64-byte chunk per group of 32 columns with their high
//   bits (byte 4 c + r, bit 2 o for column 8 o + r, bit 2 o + 1 for column 8 o + 4 + r):
//   [N / 16, K / 32 * 5, 64]; int4_mm tells them apart by the codes' shape.
// - int8: one 64-byte chunk per 4 input columns: byte 4 c + r is row c's column 4 o + r
//   ([N / 16, K / 4, 64] int8); d per tile and group as [N / 16, K / 32, 16] float16. int8_mm
//   also takes a GGUF Q6_K weight as stored, 6.5625 bits a weight (quantized_mm6.cpp).

#include "quantized_mm.h"
#include "native_isa.h"
#include "quantized_rows.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace strata_native {
namespace {


// The K-quant scales of 8 groups (kSuper layouts): 160 float16 slots (320 bytes) per tile.
constexpr int64_t kSuperGroups = 8;
constexpr int64_t kSuperHalfs = 160;

// Group g's d and m of a tile's 16 rows (the scales of the tile): float16 values, or (kSuper)
// the products of a K-quant's float16 pair and the group's 6-bit codes.
template <bool kSuper>
inline void group_scales(const uint16_t* scales, int64_t g, float* d, float* m) {
  if constexpr (kSuper) {
    const uint16_t* pair = scales + (g / kSuperGroups) * kSuperHalfs;
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(pair + 2 * kTile) + (g % 8) * 2 * kTile;
    for (int64_t c = 0; c < kTile; ++c) {
      d[c] = half_to_float(pair[c]) * static_cast<float>(codes[c]);
      m[c] = half_to_float(pair[kTile + c]) * static_cast<float>(codes[kTile + c]);
    }
  } else {
    for (int64_t c = 0; c < kTile; ++c) {
      d[c] = half_to_float(scales[g * 2 * kTile + c]);
      m[c] = half_to_float(scales[g * 2 * kTile + kTile + c]);
    }
  }
}

// One tile (16 output rows) against activation rows [r0, r0 + n): plain C++.
// A group's 64-byte chunks of codes: four of low nibbles; with 5-bit codes (kBits 5) a fifth of
// their high bits: byte 4 c + r, bit 2 o is column 8 o + r's and bit 2 o + 1 column 8 o + 4 + r's.
template <int kBits>
constexpr int64_t group_chunks() {
  return kBits == 5 ? 5 : 4;
}

template <bool kSuper, int kBits>
void tile_scalar(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q, int64_t r0,
                 int64_t n, float* out, int64_t out_stride) {
  const int64_t k = q.groups * kGroup;
  for (int64_t r = r0; r < r0 + n; ++r) {
    float acc[kTile] = {};
    for (int64_t g = 0; g < q.groups; ++g) {
      int32_t sums[kMaxPasses][kTile] = {};
      for (int p = 0; p < q.passes; ++p) {
        for (int64_t o = 0; o < kGroup / 8; ++o) {
          const uint8_t* chunk = codes + (g * group_chunks<kBits>() + o) * 64;
          const uint8_t* fifth = codes + (g * group_chunks<kBits>() + 4) * 64;
          const int8_t* a = q.codes[p].data() + r * k + g * kGroup + o * 8;
          for (int64_t c = 0; c < kTile; ++c) {
            for (int64_t j = 0; j < 4; ++j) {
              const uint8_t byte = chunk[4 * c + j];
              int32_t low = byte & 0x0F, high = byte >> 4;
              if constexpr (kBits == 5) {
                const int bits = fifth[4 * c + j] >> (2 * o);
                low |= (bits & 1) << 4;
                high |= (bits & 2) << 3;
              }
              sums[p][c] += low * a[j] + high * a[4 + j];
            }
          }
        }
      }
      float d[kTile], m[kTile];
      group_scales<kSuper>(scales, g, d, m);
      const int64_t at = r * q.groups + g;
      for (int64_t c = 0; c < kTile; ++c) {
        for (int p = 0; p < q.passes; ++p) {
          acc[c] = acc[c] + static_cast<float>(sums[p][c]) * (d[c] * q.dx[p][at]);
        }
        acc[c] = acc[c] + m[c] * q.sx[at];
      }
    }
    std::memcpy(out + (r - r0) * out_stride, acc, sizeof(acc));
  }
}

// The vector paths take rows in blocks of R (a template argument, so that the accumulators stay
// in registers); integer sums are exact in any order.
//
// AVX2: a 256-bit register holds 8 rows' codes for 8 columns, so a tile's 16 rows are two
// halves, both taken at once so that each activation broadcast serves both. vpmaddubsw gives
// u8 x s8 pairs in int16 (at most 2 * 15 * 127, 4 * 15 * 127 for the two nibbles); a group's
// four chunks add up in int16 (at most 16 * 15 * 127 = 30,480 < 2^15: no wrap), and only then
// does vpmaddwd widen the pairs to one int32 per row: one widening per group, not per chunk.
// 8 float16 values, and 8 bytes, as floats (AVX2).
__attribute__((target("avx2,fma,f16c"))) inline __m256 halves_avx2(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 bytes_avx2(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Group g's d and m of rows 8 h .. 8 h + 7 of a tile (group_scales), on AVX2.
template <bool kSuper>
__attribute__((target("avx2,fma,f16c"))) inline void group_scales_avx2(const uint16_t* scales,
                                                                      int64_t g, int h,
                                                                      __m256& d, __m256& m) {
  if constexpr (kSuper) {
    const uint16_t* pair = scales + (g / kSuperGroups) * kSuperHalfs;
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(pair + 2 * kTile) + (g % 8) * 2 * kTile;
    d = _mm256_mul_ps(halves_avx2(pair + h * 8), bytes_avx2(codes + h * 8));
    m = _mm256_mul_ps(halves_avx2(pair + kTile + h * 8), bytes_avx2(codes + kTile + h * 8));
  } else {
    d = halves_avx2(scales + g * 2 * kTile + h * 8);
    m = halves_avx2(scales + g * 2 * kTile + kTile + h * 8);
  }
}

// The two nibbles of a chunk's codes, with (kBits 5) each one's fifth bit from `bits` (the
// group's fifth chunk) at bit 4: chunk o's low nibbles' are its bits 2 o, its high ones' 2 o + 1.
template <int kBits>
__attribute__((target("avx2"))) inline void codes_avx2(const uint8_t* chunk, const uint8_t* fifth,
                                                      int64_t o, __m256i& lo, __m256i& hi) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  lo = _mm256_and_si256(w, low_nibbles);
  hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low_nibbles);
  if constexpr (kBits == 5) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(fifth));
    const __m256i fifth_bit = _mm256_set1_epi8(0x10);
    const __m256i lo_bits = o < 3 ? _mm256_slli_epi16(bits, 4 - 2 * o) : _mm256_srli_epi16(bits, 2);
    const __m256i hi_bits =
        o < 2 ? _mm256_slli_epi16(bits, 3 - 2 * o) : _mm256_srli_epi16(bits, 2 * o - 3);
    lo = _mm256_or_si256(lo, _mm256_and_si256(lo_bits, fifth_bit));
    hi = _mm256_or_si256(hi, _mm256_and_si256(hi_bits, fifth_bit));
  }
}

template <int R, int P, bool kSuper, int kBits>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_rows(const uint8_t* codes,
                                                             const uint16_t* scales,
                                                             const QuantizedRows& q, int64_t r0,
                                                             float* out, int64_t out_stride) {
  const int64_t k = q.groups * kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* rows[R][P];
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) {
    STRATA_UNROLLED
    for (int p = 0; p < P; ++p) rows[i][p] = q.codes[p].data() + (r0 + i) * k;
  }
  __m256 acc[R][2];
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    __m256i sums[R][P][2];
    STRATA_UNROLLED
    for (int i = 0; i < R; ++i) {
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) sums[i][p][0] = sums[i][p][1] = _mm256_setzero_si256();
    }
    STRATA_NOT_UNROLLED
    for (int64_t o = 0; o < kGroup / 8; ++o) {
      const uint8_t* chunk = codes + (g * group_chunks<kBits>() + o) * 64;
      const uint8_t* fifth = codes + (g * group_chunks<kBits>() + 4) * 64;
      fetch_ahead(chunk);
      if (kBits == 5 && o == 0) fetch_ahead(fifth);
      __m256i lo0, hi0, lo1, hi1;
      codes_avx2<kBits>(chunk, fifth, o, lo0, hi0);
      codes_avx2<kBits>(chunk + 32, fifth + 32, o, lo1, hi1);
      STRATA_UNROLLED
      for (int i = 0; i < R; ++i) {
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          const int8_t* a = rows[i][p] + g * kGroup + o * 8;
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, a, 4);
          std::memcpy(&a_hi, a + 4, 4);
          const __m256i b_lo = _mm256_set1_epi32(a_lo), b_hi = _mm256_set1_epi32(a_hi);
          const __m256i pairs0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, b_lo),
                                                  _mm256_maddubs_epi16(hi0, b_hi));
          const __m256i pairs1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, b_lo),
                                                  _mm256_maddubs_epi16(hi1, b_hi));
          if constexpr (kBits == 5) {  // 4 x 31 x 127 a chunk: widened at once
            sums[i][p][0] = _mm256_add_epi32(sums[i][p][0], _mm256_madd_epi16(pairs0, ones));
            sums[i][p][1] = _mm256_add_epi32(sums[i][p][1], _mm256_madd_epi16(pairs1, ones));
          } else {
            sums[i][p][0] = _mm256_add_epi16(sums[i][p][0], pairs0);
            sums[i][p][1] = _mm256_add_epi16(sums[i][p][1], pairs1);
          }
        }
      }
    }
    STRATA_UNROLLED
    for (int h = 0; h < 2; ++h) {
      __m256 d, m;
      group_scales_avx2<kSuper>(scales, g, h, d, m);
      STRATA_UNROLLED
      for (int i = 0; i < R; ++i) {
        const int64_t at = (r0 + i) * q.groups + g;
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          const __m256i sum =
              kBits == 5 ? sums[i][p][h] : _mm256_madd_epi16(sums[i][p][h], ones);
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(q.dx[p][at]));
          acc[i][h] = _mm256_add_ps(acc[i][h], _mm256_mul_ps(_mm256_cvtepi32_ps(sum), scale));
        }
        acc[i][h] = _mm256_add_ps(acc[i][h], _mm256_mul_ps(m, _mm256_set1_ps(q.sx[at])));
      }
    }
  }
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(out + i * out_stride, acc[i][0]);
    _mm256_storeu_ps(out + i * out_stride + 8, acc[i][1]);
  }
}

// AVX-512 VNNI: one register holds the tile's 16 rows for 8 columns, and vpdpbusd adds u8 x s8
// products straight into int32; two sums per row and pass (even and odd chunks), so that the
// multiply-adds do not wait on each other.

// 16 float16 values, and 16 bytes, as floats (AVX-512).
STRATA_VNNI inline __m512 halves_avx512(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

STRATA_VNNI inline __m512 bytes_avx512(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Group g's d and m of a tile's 16 rows (group_scales), on AVX-512.
template <bool kSuper>
STRATA_VNNI inline void group_scales_avx512(const uint16_t* scales, int64_t g, __m512& d,
                                            __m512& m) {
  if constexpr (kSuper) {
    const uint16_t* pair = scales + (g / kSuperGroups) * kSuperHalfs;
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(pair + 2 * kTile) + (g % 8) * 2 * kTile;
    d = _mm512_mul_ps(halves_avx512(pair), bytes_avx512(codes));
    m = _mm512_mul_ps(halves_avx512(pair + kTile), bytes_avx512(codes + kTile));
  } else {
    d = halves_avx512(scales + g * 2 * kTile);
    m = halves_avx512(scales + g * 2 * kTile + kTile);
  }
}

// codes_avx2 on AVX-512: a chunk's two nibbles, with their fifth bits (kBits 5).
template <int kBits>
STRATA_VNNI inline void codes_avx512(const uint8_t* chunk, const uint8_t* fifth, int64_t o,
                                     __m512i& lo, __m512i& hi) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i w = _mm512_loadu_si512(chunk);
  lo = _mm512_and_si512(w, low_nibbles);
  hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low_nibbles);
  if constexpr (kBits == 5) {
    const __m512i bits = _mm512_loadu_si512(fifth), fifth_bit = _mm512_set1_epi8(0x10);
    const __m512i lo_bits = o < 3 ? _mm512_slli_epi16(bits, 4 - 2 * o) : _mm512_srli_epi16(bits, 2);
    const __m512i hi_bits =
        o < 2 ? _mm512_slli_epi16(bits, 3 - 2 * o) : _mm512_srli_epi16(bits, 2 * o - 3);
    lo = _mm512_ternarylogic_epi32(lo, lo_bits, fifth_bit, 0xF8);  // a | (b & c)
    hi = _mm512_ternarylogic_epi32(hi, hi_bits, fifth_bit, 0xF8);
  }
}

template <int R, int P, bool kSuper, int kBits>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) void tile_vnni_rows(
    const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q, int64_t r0,
    float* out, int64_t out_stride) {
  const int64_t k = q.groups * kGroup;
  const int8_t* rows[R][P];
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) {
    STRATA_UNROLLED
    for (int p = 0; p < P; ++p) rows[i][p] = q.codes[p].data() + (r0 + i) * k;
  }
  __m512 acc[R];
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    __m512i sums[R][P][2];
    STRATA_UNROLLED
    for (int i = 0; i < R; ++i) {
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) sums[i][p][0] = sums[i][p][1] = _mm512_setzero_si512();
    }
    STRATA_UNROLLED
    for (int64_t o = 0; o < kGroup / 8; ++o) {
      const uint8_t* chunk = codes + (g * group_chunks<kBits>() + o) * 64;
      const uint8_t* fifth = codes + (g * group_chunks<kBits>() + 4) * 64;
      fetch_ahead(chunk);
      if (kBits == 5 && o == 0) fetch_ahead(fifth);
      __m512i lo, hi;
      codes_avx512<kBits>(chunk, fifth, o, lo, hi);
      STRATA_UNROLLED
      for (int i = 0; i < R; ++i) {
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          const int8_t* a = rows[i][p] + g * kGroup + o * 8;
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, a, 4);
          std::memcpy(&a_hi, a + 4, 4);
          __m512i& sum = sums[i][p][o & 1];
          sum = _mm512_dpbusd_epi32(sum, lo, _mm512_set1_epi32(a_lo));
          sum = _mm512_dpbusd_epi32(sum, hi, _mm512_set1_epi32(a_hi));
        }
      }
    }
    __m512 d, m;
    group_scales_avx512<kSuper>(scales, g, d, m);
    STRATA_UNROLLED
    for (int i = 0; i < R; ++i) {
      const int64_t at = (r0 + i) * q.groups + g;
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) {
        const __m512i sum = _mm512_add_epi32(sums[i][p][0], sums[i][p][1]);
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(q.dx[p][at]));
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale));
      }
      acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(m, _mm512_set1_ps(q.sx[at])));
    }
  }
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}



template <bool kSuper, int kBits>
void tile_avx2(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
               int64_t r0, int64_t n, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < n; r += avx2_rows(q.passes)) {
    by_rows(std::min(avx2_rows(q.passes), n - r), q.passes, [&](auto rows, auto passes) {
      constexpr int kRows = decltype(rows)::value, kPasses = decltype(passes)::value;
      tile_avx2_rows<kRows, kPasses, kSuper, kBits>(codes, scales, q, r0 + r, out + r * out_stride,
                                             out_stride);
    });
  }
}

template <bool kSuper, int kBits>
void tile_avx512_vnni(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                      int64_t r0, int64_t n, float* out, int64_t out_stride) {
  by_rows(n, q.passes, [&](auto rows, auto passes) {
    constexpr int kRows = decltype(rows)::value, kPasses = decltype(passes)::value;
    tile_vnni_rows<kRows, kPasses, kSuper, kBits>(codes, scales, q, r0, out, out_stride);
  });
}

int64_t cpu_path();


// The best path this CPU has, at most STRATA_NATIVE_ISA's (native_isa.h).
int64_t best_path() { return std::min(isa_cap(), cpu_path()); }

int64_t cpu_path() {
  static const int64_t path = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return kPathAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      return kPathAvx2;
    }
    return kPathScalar;
  }();
  return path;
}

template <bool kSuper, int kBits>
constexpr PathKernels kInt4Paths = {tile_scalar<kSuper, kBits>, tile_avx2<kSuper, kBits>,
                                    tile_avx512_vnni<kSuper, kBits>};

// Shared by int4_mm and int8_mm: what a scheme's layout has per tile and group, to check the
// arguments and step through them.
struct Scheme {
  const char* name;
  at::ScalarType code_type;
  int64_t chunks_per_group;   // 64-byte chunks of codes per tile and group of 32 columns
  int64_t scales_per_group;   // 16-bit slots of scales per tile and group
  const PathKernels& kernels;
  at::ScalarType scale_type = at::kHalf;  // kByte: K-quant scales, a block per 8 groups
};

at::Tensor quantized_mm(const Scheme& scheme, const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& scales, int64_t out_features, int64_t passes,
                        int64_t path) {
  const char* name = scheme.name;
  TORCH_CHECK(passes == 1 || passes == 2, name, ": passes must be 1 or 2, got ", passes);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), name, ": x must be a 2-D CPU tensor");
  TORCH_CHECK(codes.scalar_type() == scheme.code_type && codes.dim() == 3 &&
                  codes.size(2) == 64 && codes.is_contiguous(),
              name, ": codes must be contiguous ", scheme.code_type, " [N / 16, K / 32 * ",
              scheme.chunks_per_group, ", 64]");
  const int64_t k = x.size(1), tiles = codes.size(0), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && codes.size(1) == groups * scheme.chunks_per_group, name,
              ": x has ", k, " columns, the weight ", codes.size(1) / scheme.chunks_per_group * kGroup);
  const bool super = scheme.scale_type == at::kByte;
  TORCH_CHECK(!super || groups % kSuperGroups == 0, name, ": K-quant scales need K a multiple of ",
              kSuperGroups * kGroup, ", got ", k);
  TORCH_CHECK(scales.scalar_type() == scheme.scale_type && scales.is_contiguous() &&
                  scales.nbytes() == size_t(tiles * groups * scheme.scales_per_group * 2),
              name, ": scales must be contiguous ", scheme.scale_type, " with ",
              scheme.scales_per_group * 2, " bytes per tile and group");
  TORCH_CHECK(out_features <= tiles * kTile, name, ": out_features beyond the packed rows");
  const at::Tensor input = x.contiguous();
  QuantizedRows q;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "quantized_mm",
                                  [&] { q = quantize_rows<scalar_t>(input, passes); });
  const int64_t rows = q.rows;
  at::Tensor out = at::empty({rows, tiles * kTile}, x.options().dtype(at::kFloat));
  const TileKernel kernel = scheme.kernels[std::min(path < 0 ? best_path() : path, best_path())];
  const uint8_t* code_data = static_cast<const uint8_t*>(codes.const_data_ptr());
  const uint16_t* scale_data = static_cast<const uint16_t*>(scales.const_data_ptr());
  float* out_data = out.mutable_data_ptr<float>();
  const int64_t tile_codes = groups * scheme.chunks_per_group * 64;
  const int64_t tile_scales = groups * scheme.scales_per_group;
  // Tasks of at least 65,536 multiply-adds (4,096 / (K x rows) tiles): a decode row's product
  // is split between the threads too (SmolLM2 at 2 threads: its decode step 5.3-5.9 ms against
  // 6.0-6.2 with the products of a decode row kept on one thread), while the smallest products
  // stay whole.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 12) / (k * std::max<int64_t>(rows, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r = 0; r < rows; r += kRowBlock) {
        kernel(code_data + t * tile_codes, scale_data + t * tile_scales, q, r,
               std::min(kRowBlock, rows - r), out_data + r * tiles * kTile + t * kTile,
               tiles * kTile);
      }
    }
  });
  return tiles * kTile == out_features ? out : out.narrow(1, 0, out_features);
}

}  // namespace

int64_t quantized_mm_path(int64_t requested) {
  return std::min(requested < 0 ? best_path() : requested, best_path());
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t out_features, int64_t passes, int64_t path) {
  RECORD_FUNCTION("strata_native::int4_mm", std::vector<c10::IValue>());  // for profiles
  constexpr int64_t kHalves = 2 * kTile, kSuperSlots = kSuperHalfs / kSuperGroups;
  static const Scheme schemes[2][2] = {
      {{"int4_mm", at::kByte, 4, kHalves, kInt4Paths<false, 4>},
       {"int4_mm", at::kByte, 5, kHalves, kInt4Paths<false, 5>}},
      {{"int4_mm", at::kByte, 4, kSuperSlots, kInt4Paths<true, 4>, at::kByte},
       {"int4_mm", at::kByte, 5, kSuperSlots, kInt4Paths<true, 5>, at::kByte}}};
  const bool super = scales.scalar_type() == at::kByte;  // K-quant scales as stored
  // 5-bit codes (a GGUF Q5 weight's): a fifth chunk per group of 32 columns
  const bool five = x.dim() == 2 && codes.dim() == 3 && codes.size(1) * kGroup == x.size(1) * 5;
  return quantized_mm(schemes[super][five], x, codes, scales, out_features, passes, path);
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t out_features, int64_t passes, int64_t path) {
  RECORD_FUNCTION("strata_native::int8_mm", std::vector<c10::IValue>());  // for profiles
  static const Scheme scheme{"int8_mm", at::kChar, 8, kTile, kInt8Kernels};
  // uint8 scales: a GGUF Q6_K weight's 6-bit codes and scales as stored (quantized_mm6.cpp)
  static const Scheme six_bit{"int8_mm", at::kByte, 6, 18, kSixBitKernels, at::kByte};
  const bool six = scales.scalar_type() == at::kByte;
  return quantized_mm(six ? six_bit : scheme, x, codes, scales, out_features, passes, path);
}

}  // namespace strata_native

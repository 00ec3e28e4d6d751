// Strata's int4 product's tile kernels, 4- and 5-bit codes, float16 or K-quant scales, and
// 4-bit indices into IQ4's 16 levels (the layouts and the contract: quantized_mm.cpp).

#include "quantized_rows.h"

namespace strata_native {
namespace {

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

// A group's 64-byte chunks of codes: four of low nibbles; with 5-bit codes (kBits 5) a fifth of
// their high bits: byte 4 c + r, bit 2 o is column 8 o + r's and bit 2 o + 1 column 8 o + 4 + r's.
template <int kBits>
constexpr int64_t group_chunks() {
  return kBits == 5 ? 5 : 4;
}

// kBits 8: the nibbles are indices into the 16 levels of a GGUF IQ4_NL or IQ4_XS weight, each
// taken as its level + 128, an unsigned byte as u8 x s8 multiply-adds need (the weight is then
// d (level + 128) + m with m = -128 d): llama.cpp's kvalues_iq4nl, plus 128.
alignas(16) constexpr uint8_t kLevels[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                             129, 141, 153, 166, 181, 197, 217, 241};

// One tile (16 output rows) against activation rows [r0, r0 + n): plain C++.
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
              } else if constexpr (kBits == 8) {
                low = kLevels[low];
                high = kLevels[high];
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
  } else if constexpr (kBits == 8) {
    const __m256i levels =
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kLevels)));
    lo = _mm256_shuffle_epi8(levels, lo);
    hi = _mm256_shuffle_epi8(levels, hi);
  }
}

// kBits 8 on AVX2: sum(code a) over a chunk's pairs in int32, exactly. A code (level + 128, up
// to 241) times an activation overflows vpmaddubsw's int16 pairs, so the signed level's
// products (|level| <= 127, its sign moved onto the activation) and 128 sum(a) go apart.
__attribute__((target("avx2"))) inline __m256i level_pairs_avx2(__m256i codes, __m256i a) {
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const __m256i level = _mm256_xor_si256(codes, offset);  // level + 128 as a signed level
  const __m256i products = _mm256_maddubs_epi16(_mm256_abs_epi8(level), _mm256_sign_epi8(a, level));
  return _mm256_add_epi32(_mm256_madd_epi16(products, ones),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(offset, a), ones));
}

// A chunk's codes (rows 0-7: lo0, hi0; rows 8-15: lo1, hi1) against one row's 8 activations
// `a`, added to that row's two sums: in int16 pairs for 4-bit codes, widened to int32 at once
// for 5-bit ones (4 x 31 x 127 a chunk) and for levels (level_pairs_avx2).
template <int kBits>
__attribute__((target("avx2"), always_inline)) inline void add_chunk_avx2(
    __m256i lo0, __m256i hi0, __m256i lo1, __m256i hi1, const int8_t* a, __m256i (&sums)[2]) {
  int32_t a_lo, a_hi;
  std::memcpy(&a_lo, a, 4);
  std::memcpy(&a_hi, a + 4, 4);
  const __m256i b_lo = _mm256_set1_epi32(a_lo), b_hi = _mm256_set1_epi32(a_hi);
  if constexpr (kBits == 8) {
    sums[0] = _mm256_add_epi32(
        sums[0], _mm256_add_epi32(level_pairs_avx2(lo0, b_lo), level_pairs_avx2(hi0, b_hi)));
    sums[1] = _mm256_add_epi32(
        sums[1], _mm256_add_epi32(level_pairs_avx2(lo1, b_lo), level_pairs_avx2(hi1, b_hi)));
    return;
  }
  const __m256i pairs0 =
      _mm256_add_epi16(_mm256_maddubs_epi16(lo0, b_lo), _mm256_maddubs_epi16(hi0, b_hi));
  const __m256i pairs1 =
      _mm256_add_epi16(_mm256_maddubs_epi16(lo1, b_lo), _mm256_maddubs_epi16(hi1, b_hi));
  if constexpr (kBits == 5) {
    const __m256i ones = _mm256_set1_epi16(1);
    sums[0] = _mm256_add_epi32(sums[0], _mm256_madd_epi16(pairs0, ones));
    sums[1] = _mm256_add_epi32(sums[1], _mm256_madd_epi16(pairs1, ones));
  } else {
    sums[0] = _mm256_add_epi16(sums[0], pairs0);
    sums[1] = _mm256_add_epi16(sums[1], pairs1);
  }
}

template <int R, int P, bool kSuper, int kBits>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_rows(const uint8_t* codes,
                                                             const uint16_t* scales,
                                                             const QuantizedRows& q, int64_t r0,
                                                             float* out, int64_t out_stride) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* rows[R][P];
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) {
    STRATA_UNROLLED
    for (int p = 0; p < P; ++p) rows[i][p] = q.codes[p].data() + (r0 + i) * q.groups * kGroup;
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
        for (int p = 0; p < P; ++p)
          add_chunk_avx2<kBits>(lo0, hi0, lo1, hi1, rows[i][p] + g * kGroup + o * 8, sums[i][p]);
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
              kBits != 4 ? sums[i][p][h] : _mm256_madd_epi16(sums[i][p][h], ones);
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
  } else if constexpr (kBits == 8) {
    const __m512i levels =
        _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kLevels)));
    lo = _mm512_shuffle_epi8(levels, lo);
    hi = _mm512_shuffle_epi8(levels, hi);
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
      tile_avx2_rows<kRows, kPasses, kSuper, kBits>(codes, scales, q, r0 + r,
                                                    out + r * out_stride, out_stride);
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

template <bool kSuper, int kBits>
constexpr PathKernels kInt4Paths = {tile_scalar<kSuper, kBits>, tile_avx2<kSuper, kBits>,
                                    tile_avx512_vnni<kSuper, kBits>};

// AMX (AmxTileKernel, quantized_rows.h): the tile's codes, decoded once per call into B tiles
// of u8 codes (a chunk's low nibbles are B rows 2 o, its high ones 2 o + 1), then per block of
// 16 rows and group, one u8 x s8 tile multiply per pass and tile_vnni_rows's float steps.
template <int P, bool kSuper, int kBits>
STRATA_AMX void tile_amx(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                         int64_t rows, float* out, int64_t out_stride) {
  thread_local std::vector<uint8_t> decoded;
  decoded.resize(q.groups * 512);
  uint8_t* const weights = decoded.data();  // read once: a thread_local costs a call each time
  for (int64_t g = 0; g < q.groups; ++g) {
    const uint8_t* fifth = codes + (g * group_chunks<kBits>() + 4) * 64;
    STRATA_UNROLLED
    for (int64_t o = 0; o < kGroup / 8; ++o) {
      __m512i lo, hi;
      codes_avx512<kBits>(codes + (g * group_chunks<kBits>() + o) * 64, fifth, o, lo, hi);
      _mm512_storeu_si512(weights + g * 512 + 2 * o * 64, lo);
      _mm512_storeu_si512(weights + g * 512 + (2 * o + 1) * 64, hi);
    }
  }
  const AmxConfig config = amx_config();
  _tile_loadconfig(&config);
  alignas(64) int32_t sums[P][kTile][kTile];
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    __m512 acc[kTile];
    STRATA_UNROLLED_16
    for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < q.groups; ++g) {
      amx_group_sums<P, false>(weights + g * 512, q, r0 / kTile, g, sums);
      __m512 d, m;
      group_scales_avx512<kSuper>(scales, g, d, m);
      STRATA_UNROLLED_16
      for (int i = 0; i < kTile; ++i) {
        const int64_t at = (r0 + i) * q.groups + g;
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          const __m512i sum = _mm512_load_si512(sums[p][i]);
          const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(q.dx[p][at]));
          acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale));
        }
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(m, _mm512_set1_ps(q.sx[at])));
      }
    }
    STRATA_UNROLLED_16
    for (int i = 0; i < kTile; ++i) _mm512_storeu_ps(out + (r0 + i) * out_stride, acc[i]);
  }
  _tile_release();
}

template <bool kSuper, int kBits>
void tile_amx_any(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                  int64_t rows, float* out, int64_t out_stride) {
  if (q.passes == 1) return tile_amx<1, kSuper, kBits>(codes, scales, q, rows, out, out_stride);
  tile_amx<2, kSuper, kBits>(codes, scales, q, rows, out, out_stride);
}

}  // namespace

const AmxTileKernel kInt4Amx[2][2] = {{tile_amx_any<false, 4>, tile_amx_any<false, 5>},
                                      {tile_amx_any<true, 4>, tile_amx_any<true, 5>}};

const PathKernels kInt4Kernels[2][2] = {{kInt4Paths<false, 4>, kInt4Paths<false, 5>},
                                        {kInt4Paths<true, 4>, kInt4Paths<true, 5>}};
const AmxTileKernel kLevelsAmx = tile_amx_any<false, 8>;
const PathKernels kLevelsKernels = kInt4Paths<false, 8>;

}  // namespace strata_native

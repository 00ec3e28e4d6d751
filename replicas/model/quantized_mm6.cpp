// Strata's 6-bit product: a GGUF Q6_K weight as its file stores it, w = D * sc * (q - 32) with
// q in [0, 63] (6 bits), an int8 sc per row and 16 input columns, and a float16 D per row and
// 256 columns: 6.5625 bits a weight, against 8.5 for the same weight as int8 (int8_mm), and the
// file's own values, which int8 only approximates. int8_mm takes this layout where its scales
// are uint8 (quantized_mm.cpp); the activations are quantized as for the other products.
//
// Layout (replicas/model/quant.py, _strata_six_bit), in tiles of 16 output rows:
// - codes, [N / 16, K / 32 * 6, 64] uint8: per group of 32 columns, four 64-byte chunks of the
//   codes' low 4 bits exactly as int4's (byte 4 c + r: row c's column 8 o + r in its low nibble,
//   8 o + 4 + r in its high one), then two 64-byte chunks of their high 2 bits, one per half of
//   16 columns: byte 4 c + r of half h holds, from bit 0 up, the high bits of columns 16 h + r,
//   16 h + 4 + r, 16 h + 8 + r and 16 h + 12 + r of row c;
// - scales, [N / 16, K / 256, 288] uint8: per tile and 256 columns, D[16] float16, then sc[16]
//   (int8, one per row) for each of the 16 runs of 16 columns.
//
// A group's integer sum is exact whatever the instructions: per half h of 16 columns,
//   t = sc_h * (sum(q * qx) - 32 * sum(qx))
// (at most 2 * 128 * 16 * 32 * 127 in magnitude), then acc += float(t_0 + t_1) * (D * dx) per
// pass, the same float steps on every path, so a row's result is bitwise the same on every path
// and in any batch, as for the other products.

#include "quantized_rows.h"

namespace strata_native {
namespace {

constexpr int64_t kChunks = 6;          // 64-byte chunks per group of 32 columns
constexpr int64_t kHighChunk = 4;       // the first of a group's two chunks of high bits
constexpr int64_t kBlockGroups = 8;     // groups per D (256 columns)
constexpr int64_t kBlockHalfs = 144;    // 16-bit slots of scales per tile and 256 columns
constexpr int64_t kScaleBytesAt = 32;   // where a block's sc bytes start, after D[16]

// Row c's sc of half h of group g (int8 [16], one per row), and the block's D (float16 [16]).
inline const int8_t* half_scales(const uint16_t* scales, int64_t g, int h) {
  const auto* block = reinterpret_cast<const int8_t*>(scales + (g / kBlockGroups) * kBlockHalfs);
  return block + kScaleBytesAt + ((g % kBlockGroups) * 2 + h) * kTile;
}

inline const uint16_t* block_d(const uint16_t* scales, int64_t g) {
  return scales + (g / kBlockGroups) * kBlockHalfs;
}

void six_tile_scalar(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                     int64_t r0, int64_t n, float* out, int64_t out_stride) {
  const int64_t k = q.groups * kGroup;
  for (int64_t r = r0; r < r0 + n; ++r) {
    float acc[kTile] = {};
    for (int64_t g = 0; g < q.groups; ++g) {
      const uint8_t* group = codes + g * kChunks * 64;
      const int64_t at = r * q.groups + g;
      int32_t t[kMaxPasses][kTile] = {};
      for (int p = 0; p < q.passes; ++p) {
        for (int h = 0; h < 2; ++h) {
          const uint8_t* high = group + (kHighChunk + h) * 64;
          const int8_t* sc = half_scales(scales, g, h);
          const int32_t offset = 32 * activation_sum(q, p, at, h);
          for (int64_t c = 0; c < kTile; ++c) {
            int32_t sum = 0;
            for (int64_t o = 2 * h; o < 2 * h + 2; ++o) {
              const uint8_t* chunk = group + o * 64;
              const int8_t* a = q.codes[p].data() + r * k + g * kGroup + o * 8;
              const int shift = (o & 1) * 4;
              for (int64_t j = 0; j < 4; ++j) {
                const uint8_t low = chunk[4 * c + j], bits = high[4 * c + j] >> shift;
                sum += ((low & 0x0F) | ((bits & 3) << 4)) * a[j] +
                       ((low >> 4) | (((bits >> 2) & 3) << 4)) * a[4 + j];
              }
            }
            t[p][c] += sc[c] * (sum - offset);
          }
        }
      }
      const uint16_t* d = block_d(scales, g);
      for (int64_t c = 0; c < kTile; ++c) {
        for (int p = 0; p < q.passes; ++p) {
          acc[c] = acc[c] + static_cast<float>(t[p][c]) * (half_to_float(d[c]) * q.dx[p][at]);
        }
      }
    }
    std::memcpy(out + (r - r0) * out_stride, acc, sizeof(acc));
  }
}

// AVX2: rows 8 h2 .. 8 h2 + 7 of a tile are the h2-th 32 bytes of each chunk. vpmaddubsw's
// pairs are at most 2 * 63 * 127 and the two nibbles' sum 4 * 63 * 127 < 2^15; each chunk's
// sums widen to int32 (vpmaddwd) at once.
template <int P>
__attribute__((target("avx2,fma,f16c"))) void six_tile_avx2_row(const uint8_t* codes,
                                                               const uint16_t* scales,
                                                               const QuantizedRows& q,
                                                               int64_t r, float* out) {
  const int64_t k = q.groups * kGroup;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), high_pair = _mm256_set1_epi8(0x30);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < q.groups; ++g) {
    const uint8_t* group = codes + g * kChunks * 64;
    const int64_t at = r * q.groups + g;
    __m256i t[P][2];
    STRATA_UNROLLED
    for (int p = 0; p < P; ++p) t[p][0] = t[p][1] = _mm256_setzero_si256();
    STRATA_NOT_UNROLLED
    for (int h = 0; h < 2; ++h) {
      __m256i s[P][2];
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) s[p][0] = s[p][1] = _mm256_setzero_si256();
      STRATA_UNROLLED
      for (int64_t o2 = 0; o2 < 2; ++o2) {
        const int64_t o = 2 * h + o2;
        fetch_ahead(group + o * 64);
        STRATA_UNROLLED
        for (int h2 = 0; h2 < 2; ++h2) {
          const __m256i w = load_avx2(group + o * 64 + h2 * 32);
          const __m256i bits = load_avx2(group + (kHighChunk + h) * 64 + h2 * 32);
          const __m256i b_lo = o2 ? bits : _mm256_slli_epi16(bits, 4);
          const __m256i b_hi = o2 ? _mm256_srli_epi16(bits, 2) : _mm256_slli_epi16(bits, 2);
          const __m256i lo = _mm256_or_si256(_mm256_and_si256(w, low_nibbles),
                                             _mm256_and_si256(b_lo, high_pair));
          const __m256i hi = _mm256_or_si256(
              _mm256_and_si256(_mm256_srli_epi16(w, 4), low_nibbles),
              _mm256_and_si256(b_hi, high_pair));
          STRATA_UNROLLED
          for (int p = 0; p < P; ++p) {
            const int8_t* a = q.codes[p].data() + r * k + g * kGroup + o * 8;
            int32_t a_lo, a_hi;
            std::memcpy(&a_lo, a, 4);
            std::memcpy(&a_hi, a + 4, 4);
            const __m256i pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a_lo)),
                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a_hi)));
            s[p][h2] = _mm256_add_epi32(s[p][h2], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      const int8_t* sc = half_scales(scales, g, h);
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) {
        const __m256i offset = _mm256_set1_epi32(32 * activation_sum(q, p, at, h));
        STRATA_UNROLLED
        for (int h2 = 0; h2 < 2; ++h2) {
          const __m256i scv =
              _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h2)));
          const __m256i half = _mm256_mullo_epi32(scv, _mm256_sub_epi32(s[p][h2], offset));
          t[p][h2] = _mm256_add_epi32(t[p][h2], half);
        }
      }
    }
    const uint16_t* d = block_d(scales, g);
    STRATA_UNROLLED
    for (int h2 = 0; h2 < 2; ++h2) {
      const __m256 dv =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 8 * h2)));
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) {
        const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(q.dx[p][at]));
        acc[h2] = _mm256_add_ps(acc[h2], _mm256_mul_ps(_mm256_cvtepi32_ps(t[p][h2]), scale));
      }
    }
  }
  _mm256_storeu_ps(out, acc[0]);
  _mm256_storeu_ps(out + 8, acc[1]);
}

void six_tile_avx2(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                   int64_t r0, int64_t n, float* out, int64_t out_stride) {
  each_row(n, q.passes, [&](int64_t r, auto passes) {
    six_tile_avx2_row<decltype(passes)::value>(codes, scales, q, r0 + r, out + r * out_stride);
  });
}

STRATA_VNNI inline __m512i sc_avx512(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// AVX-512 VNNI: one register holds the tile's 16 rows for 8 columns; per row, pass and half,
// vpdpbusd adds the half's four u8 x s8 products straight into int32.
template <int R, int P>
STRATA_VNNI void six_tile_vnni_rows(const uint8_t* codes, const uint16_t* scales,
                                    const QuantizedRows& q, int64_t r0, float* out,
                                    int64_t out_stride) {
  const int64_t k = q.groups * kGroup;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_pair = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    const uint8_t* group = codes + g * kChunks * 64;
    __m512i s[R][P][2];
    STRATA_UNROLLED
    for (int i = 0; i < R; ++i) {
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) s[i][p][0] = s[i][p][1] = _mm512_setzero_si512();
    }
    STRATA_UNROLLED
    for (int64_t o = 0; o < 4; ++o) {
      const int h = static_cast<int>(o / 2);
      fetch_ahead(group + o * 64);
      if (o % 2 == 0) fetch_ahead(group + (kHighChunk + h) * 64);
      const __m512i w = _mm512_loadu_si512(group + o * 64);
      const __m512i bits = _mm512_loadu_si512(group + (kHighChunk + h) * 64);
      const __m512i b_lo = _mm512_and_si512(o % 2 ? bits : _mm512_slli_epi16(bits, 4), high_pair);
      const __m512i b_hi = _mm512_and_si512(
          o % 2 ? _mm512_srli_epi16(bits, 2) : _mm512_slli_epi16(bits, 2), high_pair);
      // (a & c) | b (vpternlogd): the low nibble beside the two high bits
      const __m512i lo = _mm512_ternarylogic_epi32(w, b_lo, low_nibbles, 0xEC);
      const __m512i hi =
          _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), b_hi, low_nibbles, 0xEC);
      STRATA_UNROLLED
      for (int i = 0; i < R; ++i) {
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          const int8_t* a = q.codes[p].data() + (r0 + i) * k + g * kGroup + o * 8;
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, a, 4);
          std::memcpy(&a_hi, a + 4, 4);
          __m512i& sum = s[i][p][h];
          sum = _mm512_dpbusd_epi32(sum, lo, _mm512_set1_epi32(a_lo));
          sum = _mm512_dpbusd_epi32(sum, hi, _mm512_set1_epi32(a_hi));
        }
      }
    }
    const __m512i sc[2] = {sc_avx512(half_scales(scales, g, 0)),
                           sc_avx512(half_scales(scales, g, 1))};
    const __m512 d = halves_avx512(block_d(scales, g));
    STRATA_UNROLLED
    for (int i = 0; i < R; ++i) {
      const int64_t at = (r0 + i) * q.groups + g;
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) {
        __m512i t[2];
        STRATA_UNROLLED
        for (int h = 0; h < 2; ++h) {
          const __m512i offset = _mm512_set1_epi32(32 * activation_sum(q, p, at, h));
          t[h] = _mm512_mullo_epi32(sc[h], _mm512_sub_epi32(s[i][p][h], offset));
        }
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(t[0], t[1]));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(q.dx[p][at]));
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(sum, scale));
      }
    }
  }
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}

void six_tile_avx512_vnni(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                          int64_t r0, int64_t n, float* out, int64_t out_stride) {
  by_rows(n, q.passes, [&](auto rows, auto passes) {
    constexpr int kRows = decltype(rows)::value, kPasses = decltype(passes)::value;
    six_tile_vnni_rows<kRows, kPasses>(codes, scales, q, r0, out, out_stride);
  });
}

}  // namespace

const PathKernels kSixBitKernels = {six_tile_scalar, six_tile_avx2, six_tile_avx512_vnni};

}  // namespace strata_native

// Strata's int8 product's tile kernels (the layout and the contract: quantized_mm.cpp).

#include "quantized_rows.h"

namespace strata_native {
namespace {

// The same structure as int4's, without the nibbles: a 64-byte chunk is 16 rows x 4 columns, a
// group 8 chunks. The integer sums take the signed codes three ways: plain C++; AVX2 as |w|
// (unsigned) times qx with w's sign (vpsignb) in vpmaddubsw, whose pairs stay within
// 2 * 127 * 127 < 2^15 (no saturation, but no room to add two: each chunk's pairs widen to int32
// at once), both halves of a tile per activation broadcast as int4's; AVX-512 VNNI as w + 128
// (unsigned: the code with its sign bit flipped) in vpdpbusd, less 128 times the group's sum of
// activation codes.

void int8_tile_scalar(const uint8_t* bytes, const uint16_t* scales, const QuantizedRows& q,
                      int64_t r0, int64_t n, float* out, int64_t out_stride) {
  const int8_t* codes = reinterpret_cast<const int8_t*>(bytes);
  const int64_t k = q.groups * kGroup;
  for (int64_t r = r0; r < r0 + n; ++r) {
    float acc[kTile] = {};
    for (int64_t g = 0; g < q.groups; ++g) {
      int32_t sums[kMaxPasses][kTile] = {};
      for (int p = 0; p < q.passes; ++p) {
        for (int64_t o = 0; o < kGroup / 4; ++o) {
          const int8_t* chunk = codes + (g * 8 + o) * 64;
          const int8_t* a = q.codes[p].data() + r * k + g * kGroup + o * 4;
          for (int64_t c = 0; c < kTile; ++c) {
            for (int64_t j = 0; j < 4; ++j) sums[p][c] += chunk[4 * c + j] * a[j];
          }
        }
      }
      const uint16_t* d = scales + g * kTile;
      const int64_t at = r * q.groups + g;
      for (int64_t c = 0; c < kTile; ++c) {
        for (int p = 0; p < q.passes; ++p) {
          acc[c] = acc[c] + static_cast<float>(sums[p][c]) * (half_to_float(d[c]) * q.dx[p][at]);
        }
      }
    }
    std::memcpy(out + (r - r0) * out_stride, acc, sizeof(acc));
  }
}

template <int R, int P>
__attribute__((target("avx2,fma,f16c"))) void int8_tile_avx2_rows(const uint8_t* codes,
                                                                 const uint16_t* scales,
                                                                 const QuantizedRows& q,
                                                                 int64_t r0, float* out,
                                                                 int64_t out_stride) {
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
    for (int64_t o = 0; o < kGroup / 4; ++o) {
      const int8_t* chunk = reinterpret_cast<const int8_t*>(codes) + (g * 8 + o) * 64;
      fetch_ahead(codes + (g * 8 + o) * 64);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
      const __m256i m0 = _mm256_abs_epi8(w0), m1 = _mm256_abs_epi8(w1);
      STRATA_UNROLLED
      for (int i = 0; i < R; ++i) {
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          int32_t a;
          std::memcpy(&a, rows[i][p] + g * kGroup + o * 4, 4);
          const __m256i b = _mm256_set1_epi32(a);
          const __m256i pairs0 = _mm256_maddubs_epi16(m0, _mm256_sign_epi8(b, w0));
          const __m256i pairs1 = _mm256_maddubs_epi16(m1, _mm256_sign_epi8(b, w1));
          sums[i][p][0] = _mm256_add_epi32(sums[i][p][0], _mm256_madd_epi16(pairs0, ones));
          sums[i][p][1] = _mm256_add_epi32(sums[i][p][1], _mm256_madd_epi16(pairs1, ones));
        }
      }
    }
    STRATA_UNROLLED
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * kTile + h * 8)));
      STRATA_UNROLLED
      for (int i = 0; i < R; ++i) {
        const int64_t at = (r0 + i) * q.groups + g;
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(q.dx[p][at]));
          acc[i][h] =
              _mm256_add_ps(acc[i][h], _mm256_mul_ps(_mm256_cvtepi32_ps(sums[i][p][h]), scale));
        }
      }
    }
  }
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(out + i * out_stride, acc[i][0]);
    _mm256_storeu_ps(out + i * out_stride + 8, acc[i][1]);
  }
}

template <int R, int P>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) void int8_tile_vnni_rows(
    const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q, int64_t r0,
    float* out, int64_t out_stride) {
  const int64_t k = q.groups * kGroup;
  const __m512i sign_bits = _mm512_set1_epi8(static_cast<char>(0x80));
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
    for (int64_t o = 0; o < kGroup / 4; ++o) {
      fetch_ahead(codes + (g * 8 + o) * 64);
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(codes + (g * 8 + o) * 64), sign_bits);
      STRATA_UNROLLED
      for (int i = 0; i < R; ++i) {
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          int32_t a;
          std::memcpy(&a, rows[i][p] + g * kGroup + o * 4, 4);
          __m512i& sum = sums[i][p][o & 1];
          sum = _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(a));
        }
      }
    }
    const __m512 d =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kTile)));
    STRATA_UNROLLED
    for (int i = 0; i < R; ++i) {
      const int64_t at = (r0 + i) * q.groups + g;
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) {
        const __m512i offset = _mm512_set1_epi32(128 * q.code_sums[p][at]);
        const __m512i sum =
            _mm512_sub_epi32(_mm512_add_epi32(sums[i][p][0], sums[i][p][1]), offset);
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(q.dx[p][at]));
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale));
      }
    }
  }
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}

void int8_tile_avx2(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                    int64_t r0, int64_t n, float* out, int64_t out_stride) {
  for (int64_t r = 0; r < n; r += avx2_rows(q.passes)) {
    by_rows(std::min(avx2_rows(q.passes), n - r), q.passes, [&](auto rows, auto passes) {
      constexpr int kRows = decltype(rows)::value, kPasses = decltype(passes)::value;
      int8_tile_avx2_rows<kRows, kPasses>(codes, scales, q, r0 + r, out + r * out_stride,
                                          out_stride);
    });
  }
}

void int8_tile_avx512_vnni(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                           int64_t r0, int64_t n, float* out, int64_t out_stride) {
  by_rows(n, q.passes, [&](auto rows, auto passes) {
    constexpr int kRows = decltype(rows)::value, kPasses = decltype(passes)::value;
    int8_tile_vnni_rows<kRows, kPasses>(codes, scales, q, r0, out, out_stride);
  });
}

// AMX (AmxTileKernel, quantized_rows.h): a group's eight chunks are its B tile as stored; per
// block of 16 rows and group, one s8 x s8 tile multiply per pass (the exact sums VNNI gets
// through its offset) and int8_tile_vnni_rows's float steps.
template <int P>
STRATA_AMX void int8_tile_amx(const uint8_t* codes, const uint16_t* scales,
                              const QuantizedRows& q, int64_t rows, float* out,
                              int64_t out_stride) {
  const AmxConfig config = amx_config();
  _tile_loadconfig(&config);
  alignas(64) int32_t sums[P][kTile][kTile];
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    __m512 acc[kTile];
    STRATA_UNROLLED_16
    for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < q.groups; ++g) {
      amx_group_sums<P, true>(codes + g * 8 * 64, q, r0 / kTile, g, sums);
      const __m512 d = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * kTile)));
      STRATA_UNROLLED_16
      for (int i = 0; i < kTile; ++i) {
        const int64_t at = (r0 + i) * q.groups + g;
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          const __m512i sum = _mm512_load_si512(sums[p][i]);
          const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(q.dx[p][at]));
          acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale));
        }
      }
    }
    STRATA_UNROLLED_16
    for (int i = 0; i < kTile; ++i) _mm512_storeu_ps(out + (r0 + i) * out_stride, acc[i]);
  }
  _tile_release();
}

void int8_tile_amx_any(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                       int64_t rows, float* out, int64_t out_stride) {
  if (q.passes == 1) return int8_tile_amx<1>(codes, scales, q, rows, out, out_stride);
  int8_tile_amx<2>(codes, scales, q, rows, out, out_stride);
}

}  // namespace

const AmxTileKernel kInt8Amx = int8_tile_amx_any;

const PathKernels kInt8Kernels = {int8_tile_scalar, int8_tile_avx2, int8_tile_avx512_vnni};

}  // namespace strata_native

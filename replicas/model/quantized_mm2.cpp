// Strata's 2-bit product: a GGUF Q2_K weight as its file stores it, w = d * sc * q - dmin * m
// with q in [0, 3], 4-bit sc and m per row and 16 input columns, and float16 d and dmin per row
// and 256 columns: 2.625 bits a weight, the file's own values, against 8.5 for the same weight
// as int8 (int8_mm). int4_mm takes this layout where its codes have two chunks per group of 32
// columns (quantized_mm.cpp); the activations are quantized as for the other products.
//
// Layout (replicas/model/two_bit.py, packed by weight_packing.cpp), in tiles of 16 output rows:
// - codes, [N / 16, K / 32 * 2, 64] uint8: per group of 32 columns, one 64-byte chunk per half of
//   16 columns: byte 4 c + r of half h holds, from bit 0 up, the codes of columns 16 h + r,
//   16 h + 4 + r, 16 h + 8 + r and 16 h + 12 + r of row c (the 6-bit layout's chunks of high
//   bits);
// - scales, [N / 16, K / 256, 320] uint8: per tile and 256 columns, d[16] and -dmin[16] float16
//   (one per row), then for each of the 16 runs of 16 columns a byte per row, sc | m << 4 (the
//   file's own bytes).
//
// A group's integer sums are exact whatever the instructions: per pass,
//   T = sc_0 * S_0 + sc_1 * S_1,  M = m_0 * A_0 + m_1 * A_1
// (S_h = sum(q * qx) over half h, at most 16 * 3 * 127 in magnitude; A_h the half's sum of the
// activation codes), then acc += float(T) * (d * dx); acc += float(M) * (-dmin * dx), the same
// float steps on every path, so a row's result is bitwise the same on every path and in any batch.

#include "quantized_rows.h"

namespace strata_native {
namespace {

constexpr int64_t kChunks = 2;        // 64-byte chunks per group of 32 columns
constexpr int64_t kBlockGroups = 8;   // groups per d and dmin (256 columns)
constexpr int64_t kBlockHalfs = 160;  // 16-bit slots of scales per tile and 256 columns
constexpr int64_t kRunsAt = 64;       // where a block's sc | m bytes start, after d and -dmin

// Row c's sc | m byte of half h of group g, one per row.
inline const uint8_t* half_runs(const uint16_t* scales, int64_t g, int h) {
  const auto* block = reinterpret_cast<const uint8_t*>(scales + (g / kBlockGroups) * kBlockHalfs);
  return block + kRunsAt + ((g % kBlockGroups) * 2 + h) * kTile;
}

// The block's d[16], followed by its -dmin[16] (float16).
inline const uint16_t* block_d(const uint16_t* scales, int64_t g) {
  return scales + (g / kBlockGroups) * kBlockHalfs;
}

// Both halves' sums (each within int16: at most 16 * 127) as an int16 pair, for vpmaddwd.
inline int32_t activation_pair(const QuantizedRows& q, int p, int64_t at) {
  const auto low = static_cast<uint16_t>(activation_sum(q, p, at, 0));
  const auto high = static_cast<uint16_t>(activation_sum(q, p, at, 1));
  return static_cast<int32_t>(low | (static_cast<uint32_t>(high) << 16));
}

void two_tile_scalar(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                     int64_t r0, int64_t n, float* out, int64_t out_stride) {
  const int64_t k = q.groups * kGroup;
  for (int64_t r = r0; r < r0 + n; ++r) {
    float acc[kTile] = {};
    for (int64_t g = 0; g < q.groups; ++g) {
      const int64_t at = r * q.groups + g;
      const uint16_t* d = block_d(scales, g);
      for (int p = 0; p < q.passes; ++p) {
        int32_t t[kTile] = {}, m[kTile] = {};
        for (int h = 0; h < 2; ++h) {
          const uint8_t* chunk = codes + (g * kChunks + h) * 64;
          const uint8_t* runs = half_runs(scales, g, h);
          const int8_t* a = q.codes[p].data() + r * k + g * kGroup + 16 * h;
          const int32_t sum_a = activation_sum(q, p, at, h);
          for (int64_t c = 0; c < kTile; ++c) {
            int32_t sum = 0;
            for (int w = 0; w < 4; ++w) {
              for (int64_t j = 0; j < 4; ++j) sum += ((chunk[4 * c + j] >> (2 * w)) & 3) * a[4 * w + j];
            }
            t[c] += (runs[c] & 15) * sum;
            m[c] += (runs[c] >> 4) * sum_a;
          }
        }
        for (int64_t c = 0; c < kTile; ++c) {
          acc[c] = acc[c] + static_cast<float>(t[c]) * (half_to_float(d[c]) * q.dx[p][at]);
          acc[c] = acc[c] + static_cast<float>(m[c]) * (half_to_float(d[kTile + c]) * q.dx[p][at]);
        }
      }
    }
    std::memcpy(out + (r - r0) * out_stride, acc, sizeof(acc));
  }
}

// AVX2: group g's float steps (float_steps' order) for rows 8 h2 .. 8 h2 + 7 of a tile, from the
// halves' sums s[pass][half].
template <int P>
__attribute__((target("avx2,fma,f16c"))) inline __m256 float_steps_avx2(
    __m256 acc, const __m256i (*s)[2], const uint16_t* scales, const QuantizedRows& q, int64_t g,
    int64_t at, int h2) {
  __m256i sc[2], mn[2];
  STRATA_UNROLLED
  for (int h = 0; h < 2; ++h) {
    const __m256i runs = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(half_runs(scales, g, h) + 8 * h2)));
    sc[h] = _mm256_and_si256(runs, _mm256_set1_epi32(15));
    mn[h] = _mm256_srli_epi32(runs, 4);
  }
  const uint16_t* d = block_d(scales, g) + 8 * h2;
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
  const __m256 nmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kTile)));
  STRATA_UNROLLED
  for (int p = 0; p < P; ++p) {
    const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(sc[0], s[p][0]),
                                       _mm256_mullo_epi32(sc[1], s[p][1]));
    const __m256i m =
        _mm256_add_epi32(_mm256_mullo_epi32(mn[0], _mm256_set1_epi32(activation_sum(q, p, at, 0))),
                         _mm256_mullo_epi32(mn[1], _mm256_set1_epi32(activation_sum(q, p, at, 1))));
    const __m256 dx = _mm256_set1_ps(q.dx[p][at]);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dv, dx)));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(nmin, dx)));
  }
  return acc;
}

// AVX2: rows 8 h2 .. 8 h2 + 7 of a tile are the h2-th 32 bytes of each chunk. A half's four
// vpmaddubsw pairs add up in int16 (at most 4 * 2 * 3 * 127) before widening (vpmaddwd).
template <int P>
__attribute__((target("avx2,fma,f16c"))) void two_tile_avx2_row(const uint8_t* codes,
                                                               const uint16_t* scales,
                                                               const QuantizedRows& q,
                                                               int64_t r, float* out) {
  const int64_t k = q.groups * kGroup;
  const __m256i pair = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < q.groups; ++g) {
    const uint8_t* group = codes + g * kChunks * 64;
    const int64_t at = r * q.groups + g;
    fetch_ahead(group);
    fetch_ahead(group + 64);
    STRATA_NOT_UNROLLED
    for (int h2 = 0; h2 < 2; ++h2) {
      __m256i s[P][2];
      STRATA_UNROLLED
      for (int h = 0; h < 2; ++h) {
        const __m256i w = load_avx2(group + h * 64 + h2 * 32);
        __m256i pairs[P];
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) pairs[p] = _mm256_setzero_si256();
        STRATA_UNROLLED
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_and_si256(_mm256_srli_epi16(w, 2 * j), pair);
          STRATA_UNROLLED
          for (int p = 0; p < P; ++p) {
            int32_t a4;
            std::memcpy(&a4, q.codes[p].data() + r * k + g * kGroup + 16 * h + 4 * j, 4);
            pairs[p] = _mm256_add_epi16(pairs[p], _mm256_maddubs_epi16(v, _mm256_set1_epi32(a4)));
          }
        }
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) s[p][h] = _mm256_madd_epi16(pairs[p], ones);
      }
      acc[h2] = float_steps_avx2<P>(acc[h2], s, scales, q, g, at, h2);
    }
  }
  _mm256_storeu_ps(out, acc[0]);
  _mm256_storeu_ps(out + 8, acc[1]);
}

void two_tile_avx2(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                   int64_t r0, int64_t n, float* out, int64_t out_stride) {
  each_row(n, q.passes, [&](int64_t r, auto passes) {
    two_tile_avx2_row<decltype(passes)::value>(codes, scales, q, r0 + r, out + r * out_stride);
  });
}

STRATA_VNNI inline __m512i runs_avx512(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A group's float steps for one pass, the same on every path: acc + T (d dx) + M (-dmin dx).
STRATA_VNNI inline __m512 float_steps(__m512 acc, __m512i t, __m512i m, __m512 d, __m512 nmin,
                                      float dx) {
  const __m512 dxv = _mm512_set1_ps(dx);
  acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, dxv)));
  return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(nmin, dxv)));
}

// Group g's (sc_0, sc_1) and (m_0, m_1) per row as int16 pairs, for vpmaddwd.
STRATA_VNNI inline void run_pairs_avx512(const uint16_t* scales, int64_t g, __m512i& sc,
                                         __m512i& mn) {
  const __m512i low_nibble = _mm512_set1_epi32(15);
  const __m512i runs0 = runs_avx512(half_runs(scales, g, 0));
  const __m512i runs1 = runs_avx512(half_runs(scales, g, 1));
  sc = _mm512_or_si512(_mm512_and_si512(runs0, low_nibble),
                       _mm512_slli_epi32(_mm512_and_si512(runs1, low_nibble), 16));
  mn = _mm512_or_si512(_mm512_srli_epi32(runs0, 4),
                       _mm512_slli_epi32(_mm512_srli_epi32(runs1, 4), 16));
}

// AVX-512 VNNI: one register holds the tile's 16 rows for 4 columns; per row, pass and half,
// vpdpbusd adds four columns' u8 x s8 products straight into int32, four times a chunk.
template <int R, int P>
STRATA_VNNI void two_tile_vnni_rows(const uint8_t* codes, const uint16_t* scales,
                                    const QuantizedRows& q, int64_t r0, float* out,
                                    int64_t out_stride) {
  const int64_t k = q.groups * kGroup;
  const __m512i pair = _mm512_set1_epi8(3);
  __m512 acc[R];
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    const uint8_t* group = codes + g * kChunks * 64;
    __m512i s[R][P][2];
    STRATA_UNROLLED
    for (int h = 0; h < 2; ++h) {
      fetch_ahead(group + h * 64);
      const __m512i w = _mm512_loadu_si512(group + h * 64);
      STRATA_UNROLLED
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_and_si512(_mm512_srli_epi16(w, 2 * j), pair);
        STRATA_UNROLLED
        for (int i = 0; i < R; ++i) {
          STRATA_UNROLLED
          for (int p = 0; p < P; ++p) {
            int32_t a4;
            std::memcpy(&a4, q.codes[p].data() + (r0 + i) * k + g * kGroup + 16 * h + 4 * j, 4);
            __m512i& sum = s[i][p][h];
            sum = _mm512_dpbusd_epi32(j == 0 ? _mm512_setzero_si512() : sum, v,
                                      _mm512_set1_epi32(a4));
          }
        }
      }
    }
    __m512i sc, mn;
    run_pairs_avx512(scales, g, sc, mn);
    const __m512 d = halves_avx512(block_d(scales, g));
    const __m512 nmin = halves_avx512(block_d(scales, g) + kTile);
    STRATA_UNROLLED
    for (int i = 0; i < R; ++i) {
      const int64_t at = (r0 + i) * q.groups + g;
      STRATA_UNROLLED
      for (int p = 0; p < P; ++p) {
        // S_0 and S_1 (each within int16) as a pair per lane, then sc_0 S_0 + sc_1 S_1
        const __m512i halves = _mm512_mask_blend_epi16(0xAAAAAAAA, s[i][p][0],
                                                       _mm512_slli_epi32(s[i][p][1], 16));
        const __m512i t = _mm512_madd_epi16(halves, sc);
        const __m512i m = _mm512_madd_epi16(_mm512_set1_epi32(activation_pair(q, p, at)), mn);
        acc[i] = float_steps(acc[i], t, m, d, nmin, q.dx[p][at]);
      }
    }
  }
  STRATA_UNROLLED
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * out_stride, acc[i]);
}

void two_tile_avx512_vnni(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                          int64_t r0, int64_t n, float* out, int64_t out_stride) {
  by_rows(n, q.passes, [&](auto rows, auto passes) {
    constexpr int kRows = decltype(rows)::value, kPasses = decltype(passes)::value;
    two_tile_vnni_rows<kRows, kPasses>(codes, scales, q, r0, out, out_stride);
  });
}

// AMX (AmxTileKernel, quantized_rows.h): the tile's codes, decoded once per call into B tiles of
// u8 codes times their run's sc (at most 3 * 15, so a group's tile multiply gives T itself:
// B row 4 h + w holds a half's codes of shift 2 w), then per block of 16 rows and group, one u8
// x s8 tile multiply per pass and two_tile_vnni_rows's float steps.
STRATA_AMX inline void decode_group_amx(const uint8_t* group, const uint16_t* scales, int64_t g,
                                        uint8_t* weights) {
  const __m512i pair = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1), two = _mm512_set1_epi8(2);
  STRATA_UNROLLED
  for (int h = 0; h < 2; ++h) {
    const __m512i w = _mm512_loadu_si512(group + h * 64);
    // row c's sc in each of its four bytes
    const __m512i sc = _mm512_mullo_epi32(
        _mm512_and_si512(runs_avx512(half_runs(scales, g, h)), _mm512_set1_epi32(15)),
        _mm512_set1_epi32(0x01010101));
    const __m512i sc2 = _mm512_add_epi8(sc, sc);
    STRATA_UNROLLED
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_and_si512(_mm512_srli_epi16(w, 2 * j), pair);
      const __m512i scaled = _mm512_add_epi8(_mm512_maskz_mov_epi8(_mm512_test_epi8_mask(v, one), sc),
                                             _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(v, two), sc2));
      _mm512_storeu_si512(weights + (4 * h + j) * 64, scaled);
    }
  }
}

template <int P>
STRATA_AMX void two_tile_amx(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                             int64_t rows, float* out, int64_t out_stride) {
  thread_local std::vector<uint8_t> decoded;
  decoded.resize(q.groups * 512);
  uint8_t* const weights = decoded.data();  // read once: a thread_local costs a call each time
  for (int64_t g = 0; g < q.groups; ++g) {
    decode_group_amx(codes + g * kChunks * 64, scales, g, weights + g * 512);
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
      __m512i sc, mn;
      run_pairs_avx512(scales, g, sc, mn);
      const __m512 d = halves_avx512(block_d(scales, g));
      const __m512 nmin = halves_avx512(block_d(scales, g) + kTile);
      STRATA_UNROLLED_16
      for (int i = 0; i < kTile; ++i) {
        const int64_t at = (r0 + i) * q.groups + g;
        STRATA_UNROLLED
        for (int p = 0; p < P; ++p) {
          const __m512i t = _mm512_load_si512(sums[p][i]);
          const __m512i m = _mm512_madd_epi16(_mm512_set1_epi32(activation_pair(q, p, at)), mn);
          acc[i] = float_steps(acc[i], t, m, d, nmin, q.dx[p][at]);
        }
      }
    }
    STRATA_UNROLLED_16
    for (int i = 0; i < kTile; ++i) _mm512_storeu_ps(out + (r0 + i) * out_stride, acc[i]);
  }
  _tile_release();
}

void two_tile_amx_any(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                      int64_t rows, float* out, int64_t out_stride) {
  if (q.passes == 1) return two_tile_amx<1>(codes, scales, q, rows, out, out_stride);
  two_tile_amx<2>(codes, scales, q, rows, out, out_stride);
}

}  // namespace

const PathKernels kTwoBitKernels = {two_tile_scalar, two_tile_avx2, two_tile_avx512_vnni};
const AmxTileKernel kTwoBitAmx = two_tile_amx_any;

}  // namespace strata_native

// What Strata's quantized products share (quantized_mm.cpp, quantized_mm8.cpp,
// quantized_mm6.cpp): the activations quantized on the fly, the tile kernels' signature and the
// helpers their instruction paths have in common. Layouts and the bitwise contract:
// quantized_mm.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace strata_native {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kRowBlock = 4;  // activation rows sharing one pass over a tile's weights

constexpr int kMaxPasses = 2;

// The vector kernels ask for a tile's codes this many bytes ahead of those they read
// (_mm_prefetch). The weights stream from memory once a token, and the hardware's own fetch-ahead
// alone left the int4 product below the machine's read bandwidth (docs/design.md, "Strata's
// int4 and int8 products").
constexpr int64_t kFetchAhead = 2048;
inline void fetch_ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kFetchAhead), _MM_HINT_T0);
}

// AVX2 has 16 vector registers: a block of rows keeps 4 x rows x passes accumulators in them
// beside a chunk's weights, so two passes take rows two at a time (four would spill the sums to
// memory on every multiply-add: 1.8x slower, measured).
constexpr int64_t avx2_rows(int passes) { return passes == 2 ? 2 : kRowBlock; }

// The vector kernels index their accumulators by loop counters (row, pass, chunk); the sums stay
// in registers only where those loops are unrolled, which -O2 does not do on its own. The loop
// over a group's chunks stays rolled where unrolling it lets the compiler reorder every
// multiply-add ahead of the adds (AVX2: more live products than registers).
#define STRATA_UNROLLED _Pragma("GCC unroll 8")
#define STRATA_NOT_UNROLLED _Pragma("GCC unroll 1")

// Activations of one call, quantized in one or two passes: per row and group, x ~ dx[0] *
// codes[0] (+ dx[1] * codes[1]), a second pass quantizing what the first left (so a row keeps
// about 15 bits of its group's largest value, not 8; each pass is as much integer work again),
// and sx, the sum of x.
struct QuantizedRows {
  int64_t rows = 0, groups = 0;
  int passes = 0;
  std::vector<int8_t> codes[kMaxPasses];  // [rows, groups * 32] each
  std::vector<float> dx[kMaxPasses], sx;  // [rows, groups] each
  std::vector<int32_t> code_sums[kMaxPasses];  // [rows, groups] each: sums of codes (int8_mm)
  std::vector<int32_t> half_sums[kMaxPasses];  // [rows, groups] each: of a group's first 16
  std::vector<int8_t> tiled[kMaxPasses];  // AMX: the codes as A tiles (tile_rows)
};

// The codes of rows [0, rows), a multiple of 16, as AMX A tiles, [rows / 16, groups, 16, 32]
// per pass: a tile's 512 bytes in a row, where rows K bytes apart (K a multiple of 4,096) would
// share one L1 set.
inline void tile_rows(QuantizedRows& q, int64_t rows) {
  const int64_t k = q.groups * kGroup, blocks = rows / 16;
  for (int p = 0; p < q.passes; ++p) {
    q.tiled[p].resize(rows * k);
    const int8_t* codes = q.codes[p].data();
    int8_t* tiled = q.tiled[p].data();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t g = 0; g < q.groups; ++g) {
          for (int64_t i = 0; i < 16; ++i) {
            std::memcpy(tiled + ((b * q.groups + g) * 16 + i) * kGroup,
                        codes + (b * 16 + i) * k + g * kGroup, kGroup);
          }
        }
      }
    });
  }
}

// v rounded to the nearest integer, ties to even, for |v| < 2^22 (here at most 127): adding and
// subtracting 1.5 * 2^23 leaves no fraction bits (std::nearbyint's result, without its call).
inline float round_small(float v) {
  constexpr float kShift = 12582912.0f;
  volatile float shifted = v + kShift;
  return shifted - kShift;
}

template <typename scalar_t>
QuantizedRows quantize_rows(const at::Tensor& x, int passes) {
  QuantizedRows q;
  q.rows = x.size(0);
  q.passes = passes;
  const int64_t k = x.size(1);
  q.groups = k / kGroup;
  for (int p = 0; p < passes; ++p) {
    q.codes[p].resize(q.rows * k);
    q.dx[p].resize(q.rows * q.groups);
    q.code_sums[p].resize(q.rows * q.groups);
    q.half_sums[p].resize(q.rows * q.groups);
  }
  q.sx.resize(q.rows * q.groups);
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  at::parallel_for(0, q.rows, 16, [&](int64_t begin, int64_t end) {
    float group[kGroup];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < q.groups; ++g) {
        float sum = 0.0f;
        for (int64_t i = 0; i < kGroup; ++i) {
          group[i] = static_cast<float>(data[r * k + g * kGroup + i]);
          sum += group[i];
        }
        q.sx[r * q.groups + g] = sum;
        for (int p = 0; p < passes; ++p) {  // group[] becomes what the pass left
          float amax = 0.0f;
          for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(group[i]));
          const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
          int8_t* codes = q.codes[p].data() + r * k + g * kGroup;
          int32_t code_sum = 0, half_sum = 0;
          for (int64_t i = 0; i < kGroup; ++i) {
            const float code = round_small(group[i] * inverse);
            codes[i] = static_cast<int8_t>(code);
            code_sum += codes[i];
            if (i == kGroup / 2 - 1) half_sum = code_sum;
            group[i] = group[i] - code * d;
          }
          q.dx[p][r * q.groups + g] = d;
          q.code_sums[p][r * q.groups + g] = code_sum;
          q.half_sums[p][r * q.groups + g] = half_sum;
        }
      }
    }
  });
  return q;
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// The activation codes' sum over half h (16 columns) of a group, pass p, at row r and group g
// (`at` = r * groups + g): the 6-bit and 2-bit layouts' scales are per half.
inline int32_t activation_sum(const QuantizedRows& q, int p, int64_t at, int h) {
  return h == 0 ? q.half_sums[p][at] : q.code_sums[p][at] - q.half_sums[p][at];
}

__attribute__((target("avx2"))) inline __m256i load_avx2(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Rows [r0, r0 + n), one at a time, through `row(r, passes)` with q's passes as a constant (the
// AVX2 kernels of the 6-bit and 2-bit layouts take a row at a time).
template <typename Row>
void each_row(int64_t n, int passes, const Row& row) {
  for (int64_t r = 0; r < n; ++r) {
    if (passes == 1) row(r, std::integral_constant<int, 1>{});
    else row(r, std::integral_constant<int, 2>{});
  }
}

#define STRATA_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

// 16 float16 values as float32.
STRATA_VNNI inline __m512 halves_avx512(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#define STRATA_AMX \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
#define STRATA_UNROLLED_16 _Pragma("GCC unroll 16")

// Rows [r0, r0 + n) of one tile, n <= kRowBlock, with q's passes, through the vector kernels'
// instance for them (each keeps its accumulators in registers).
template <typename Kernel>
void by_rows(int64_t n, int passes, const Kernel& kernel) {
  const auto with_rows = [&](auto p) {
    switch (n) {
      case 1: return kernel(std::integral_constant<int, 1>{}, p);
      case 2: return kernel(std::integral_constant<int, 2>{}, p);
      case 3: return kernel(std::integral_constant<int, 3>{}, p);
      default: return kernel(std::integral_constant<int, 4>{}, p);
    }
  };
  if (passes == 1) return with_rows(std::integral_constant<int, 1>{});
  return with_rows(std::integral_constant<int, 2>{});
}

using TileKernel = void (*)(const uint8_t*, const uint16_t*, const QuantizedRows&, int64_t,
                            int64_t, float*, int64_t);

// One kernel per instruction path, indexed by kPath*.
using PathKernels = std::array<TileKernel, 3>;

// AMX (kPathAmx): a tile kernel for a whole weight tile and rows [0, rows), rows a multiple of
// 16: per group of 32 columns and block of 16 rows, one tile multiply per pass gives the 16 x 16
// int32 sums the VNNI kernels add up (exact either way), and the float steps that follow are
// theirs, in their order, so every path gives the same bits. Tiles: C, one per pass (16 rows x
// 16 int32); A, one per pass (16 rows x 32 int8 codes); B, the group's weights (8 rows of 4
// columns x 16 output rows, the layout of an int8 tile's chunks and of an int4 tile's nibbles).
using AmxTileKernel = void (*)(const uint8_t* codes, const uint16_t* scales, const QuantizedRows& q,
                               int64_t rows, float* out, int64_t out_stride);

// Whether AMX is usable in this process (the CPU has it and Linux lets this process use it).
bool amx_ready();

struct AmxConfig {  // the LDTILECFG operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0, 1: C per pass; 2, 3: A per pass; 4: B.
inline AmxConfig amx_config() {
  AmxConfig config;
  for (int t = 0; t < 2; ++t) {
    config.rows[t] = 16, config.colsb[t] = 64;
    config.rows[2 + t] = 16, config.colsb[2 + t] = 32;
  }
  config.rows[4] = 8, config.colsb[4] = 64;
  return config;
}

// Group g's integer sums of rows [16 block, 16 block + 16), per pass, into sums[p][row][column]
// (tiles as amx_config() sets them): the group's B tile (`weights`, 8 rows of 64 bytes) times
// the rows' codes (tile_rows), s8 x u8 (int4 codes) or, kSigned, s8 x s8 (int8 codes).
template <int P, bool kSigned>
STRATA_AMX inline void amx_group_sums(const void* weights, const QuantizedRows& q, int64_t block,
                                      int64_t g, int32_t (*sums)[kTile][kTile]) {
  _tile_loadd(4, weights, 64);
  _tile_zero(0);
  _tile_loadd(2, q.tiled[0].data() + (block * q.groups + g) * 512, kGroup);
  if constexpr (kSigned) _tile_dpbssd(0, 2, 4);
  else _tile_dpbsud(0, 2, 4);
  _tile_stored(0, sums[0], 64);
  if constexpr (P == 2) {
    _tile_zero(1);
    _tile_loadd(3, q.tiled[1].data() + (block * q.groups + g) * 512, kGroup);
    if constexpr (kSigned) _tile_dpbssd(1, 3, 4);
    else _tile_dpbsud(1, 3, 4);
    _tile_stored(1, sums[P - 1], 64);
  }
}

// The K-quant scales of 8 groups (an int4 layout's, kSuper): 160 float16 slots (320 bytes) per
// tile.
constexpr int64_t kSuperGroups = 8;
constexpr int64_t kSuperHalfs = 160;

// The tile kernels by path: int4's by [K-quant scales][5-bit codes] (quantized_mm4.cpp); the
// int8 layout's, and the 6-bit one's (a GGUF Q6_K weight as stored; quantized_mm8.cpp,
// quantized_mm6.cpp).
extern const PathKernels kInt4Kernels[2][2];
extern const PathKernels kInt8Kernels;
extern const PathKernels kSixBitKernels;
// The 2-bit layout's (a GGUF Q2_K weight as stored; quantized_mm2.cpp), under int4_mm.
extern const PathKernels kTwoBitKernels;
extern const AmxTileKernel kTwoBitAmx;
// The AMX tile kernels: int4's by [K-quant scales][5-bit codes]; int8's (not the 6-bit layout's).
extern const AmxTileKernel kInt4Amx[2][2];
// int4's layout with IQ4's levels in place of its codes (quantized_mm4.cpp: kBits 8).
extern const PathKernels kLevelsKernels;
extern const AmxTileKernel kLevelsAmx;
extern const AmxTileKernel kInt8Amx;

}  // namespace strata_native

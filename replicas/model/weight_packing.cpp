// Packing at load: a weight's codes into the layouts of Strata's int4, 6-bit and 2-bit products
// (quantized_mm.cpp, quantized_mm6.cpp, quantized_mm2.cpp), and a GGUF Q6_K weight's fields out of its blocks. Each
// is one pass over the weight, tiles of 16 rows in parallel; replicas/model/quant.py and
// replicas/model/six_bit.py hold the same packing written in torch ops, which the tests compare
// these with byte for byte.

#include "weight_packing.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

namespace strata_native {
namespace {

constexpr int64_t kTile = 16;      // rows per tile
constexpr int64_t kGroup = 32;     // columns per group
constexpr int64_t kBlock = 256;    // columns per Q6_K block (and per 6-bit D)
constexpr int64_t kQ6KBytes = 210; // a Q6_K block: ql[128], qh[64], sc[16] (int8), d (float16)
constexpr int64_t kQ2KBytes = 84;  // a Q2_K block: sc | m [16], qs[64], d, dmin (float16)
constexpr float kFloat16MinNormal = 0x1p-14f;

void check_rows(const at::Tensor& t, const char* what, at::ScalarType type) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == type,
              what, " must be a contiguous 2-d CPU tensor of ", type);
}

// A row's 32 codes of one group as their low 4 bits in the group's four 64-byte chunks of
// nibbles (int4's, and the 6-bit layout's first four): byte 4 c + r of chunk o (`group` points
// at row c's bytes) holds column 8 o + r in its low nibble and 8 o + 4 + r in its high one.
inline void nibble_chunks(const uint8_t* q, uint8_t* group) {
  for (int64_t o = 0; o < 4; ++o) {
    for (int64_t r = 0; r < 4; ++r) {
      group[o * 64 + r] = (q[8 * o + r] & 15) | ((q[8 * o + 4 + r] & 15) << 4);
    }
  }
}

// Tiles [begin, end) of int4 chunks: per tile, K / 8 chunks of nibbles (byte 4 c + r: row c's
// column 8 o + r in its low nibble, 8 o + 4 + r in its high one), and with `five` a fifth chunk
// per group after its four (bit 2 o + h of byte 4 c + r: the fifth bit of row c's column
// 32 g + 8 o + 4 h + r).
void pack_int4_tiles(const uint8_t* codes, uint8_t* out, int64_t k, bool five, int64_t begin,
                     int64_t end) {
  const int64_t groups = k / kGroup, chunks = five ? 5 : 4;
  for (int64_t t = begin; t < end; ++t) {
    uint8_t* tile = out + t * groups * chunks * 64;
    for (int64_t c = 0; c < kTile; ++c) {
      const uint8_t* row = codes + (t * kTile + c) * k;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* q = row + g * kGroup;
        uint8_t* group = tile + g * chunks * 64 + 4 * c;
        nibble_chunks(q, group);
        if (!five) continue;
        for (int64_t r = 0; r < 4; ++r) {
          uint8_t bits = 0;
          for (int64_t o = 0; o < 4; ++o) {
            bits |= ((q[8 * o + r] >> 4) & 1) << (2 * o);
            bits |= ((q[8 * o + 4 + r] >> 4) & 1) << (2 * o + 1);
          }
          group[4 * 64 + r] = bits;
        }
      }
    }
  }
}

// One row of Q6_K blocks into its codes (uint8 in [0, 63]), scales and D: code j of a block is
// ql's low 4 bits (byte 64 h + i, nibble n: j = 128 h + 64 n + i) and qh's high 2 (byte
// 32 h + i, bits 2 w: j = 128 h + 32 w + i).
void q6_k_row(const uint8_t* blocks, int64_t count, uint8_t* codes, int8_t* sc, uint16_t* d) {
  for (int64_t b = 0; b < count; ++b) {
    const uint8_t* block = blocks + b * kQ6KBytes;
    const uint8_t *ql = block, *qh = block + 128;
    uint8_t* q = codes + b * kBlock;
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t i = 0; i < 64; ++i) {
        q[128 * h + i] = ql[64 * h + i] & 15;
        q[128 * h + 64 + i] = ql[64 * h + i] >> 4;
      }
      for (int64_t w = 0; w < 4; ++w) {
        for (int64_t i = 0; i < 32; ++i) {
          q[128 * h + 32 * w + i] |= ((qh[32 * h + i] >> (2 * w)) & 3) << 4;
        }
      }
    }
    std::memcpy(sc + b * 16, block + 192, 16);
    std::memcpy(d + b, block + 208, 2);
  }
}

// Tiles [begin, end) of the 6-bit layout; rows past `n` are zeros.
void pack_six_bit_tiles(const uint8_t* codes, const int8_t* sc, const uint16_t* d, int64_t n,
                        int64_t k, uint8_t* packed, uint8_t* scales, int64_t begin, int64_t end) {
  const int64_t groups = k / kGroup, blocks = k / kBlock;
  for (int64_t t = begin; t < end; ++t) {
    uint8_t* tile = packed + t * groups * 6 * 64;
    uint8_t* tile_scales = scales + t * blocks * 288;
    for (int64_t c = 0; c < kTile; ++c) {
      const int64_t row = t * kTile + c;
      if (row >= n) continue;  // the caller's zeros
      const uint8_t* q = codes + row * k;
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* group = tile + g * 6 * 64 + 4 * c;
        const uint8_t* x = q + g * kGroup;
        nibble_chunks(x, group);
        for (int64_t h = 0; h < 2; ++h) {
          for (int64_t r = 0; r < 4; ++r) {
            uint8_t bits = 0;
            for (int64_t w = 0; w < 4; ++w) bits |= (x[16 * h + 4 * w + r] >> 4) << (2 * w);
            group[(4 + h) * 64 + r] = bits;
          }
        }
      }
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* block = tile_scales + b * 288;
        std::memcpy(block + 2 * c, d + row * blocks + b, 2);
        for (int64_t s = 0; s < 16; ++s) block[32 + s * kTile + c] = sc[row * blocks * 16 + b * 16 + s];
      }
    }
  }
}

// Q4_K blocks of 144 bytes (or Q5_K ones of 176) into their codes, [8 groups][32]: byte
// 32 c + l of qs holds weight l of group 2 c in its low nibble and of group 2 c + 1 in its high
// one; Q5_K's fifth bit of group g's weight l is bit g of qh byte l.
void k_quant_block(const uint8_t* block, bool five, uint8_t* codes) {
  const uint8_t* qh = block + 16;
  const uint8_t* qs = block + (five ? 48 : 16);
  for (int64_t c = 0; c < 4; ++c) {
    uint8_t* low = codes + 64 * c;
    uint8_t* high = low + 32;
    for (int64_t l = 0; l < 32; ++l) {
      low[l] = qs[32 * c + l] & 15;
      high[l] = qs[32 * c + l] >> 4;
    }
    if (!five) continue;
    for (int64_t l = 0; l < 32; ++l) {
      low[l] |= ((qh[l] >> (2 * c)) & 1) << 4;
      high[l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
    }
  }
}

// Two-bit codes (Q2_K's, Q3_K's low bits): per 128 weights 32 bytes, weight 32 s + l in bits
// 2 s of byte l.
inline uint8_t two_bit(const uint8_t* q, int64_t j) {
  const int64_t h = j / 128, s = (j % 128) / 32, l = j % 32;
  return (q[32 * h + l] >> (2 * s)) & 3;
}

inline float f16_at(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// A Q2_K block of 84 bytes as float32 [256]: (d sc) q - dmin m per 16 weights, rounded as
// gguf_dequantize._q2_k's ops round (a product, then a difference).
void q2_k_block(const uint8_t* block, float* out) {
  const float d = f16_at(block + 80), dmin = f16_at(block + 82);
  for (int64_t s = 0; s < 16; ++s) {  // runs of 16 weights, a scale and a minimum each
    const float dl = d * static_cast<float>(block[s] & 15);
    const float ml = dmin * static_cast<float>(block[s] >> 4);
    for (int64_t j = 16 * s; j < 16 * s + 16; ++j) {
      const float scaled = static_cast<float>(two_bit(block + 16, j)) * dl;
      out[j] = scaled - ml;
    }
  }
}

// Tiles [begin, end) of the 2-bit layout (quantized_mm2.cpp) from Q2_K rows of `blocks` blocks
// of 84 bytes (sc | m per run of 16 weights, then 64 bytes of codes, d and dmin); rows past `n`
// are zeros.
void pack_two_bit_tiles(const uint8_t* rows, int64_t n, int64_t blocks, uint8_t* packed,
                        uint8_t* scales, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t c = 0; c < kTile && t * kTile + c < n; ++c) {
      const uint8_t* row = rows + (t * kTile + c) * blocks * kQ2KBytes;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = row + b * kQ2KBytes;
        uint8_t* out = scales + (t * blocks + b) * 320;
        uint16_t dmin;
        std::memcpy(out + 2 * c, block + 80, 2);
        std::memcpy(&dmin, block + 82, 2);
        dmin ^= 0x8000;  // -dmin, exactly
        std::memcpy(out + 32 + 2 * c, &dmin, 2);
        for (int64_t s = 0; s < 16; ++s) out[64 + s * kTile + c] = block[s];
        for (int64_t g = 0; g < kBlock / kGroup; ++g) {
          uint8_t* group = packed + ((t * blocks + b) * 8 + g) * 2 * 64 + 4 * c;
          for (int64_t h = 0; h < 2; ++h) {
            for (int64_t r = 0; r < 4; ++r) {
              uint8_t bits = 0;
              for (int64_t w = 0; w < 4; ++w) {
                bits |= two_bit(block + 16, kGroup * g + 16 * h + 4 * w + r) << (2 * w);
              }
              group[h * 64 + r] = bits;
            }
          }
        }
      }
    }
  }
}

// A Q3_K block of 110 bytes as its codes (int8 in [-4, 3]), scales (int8, sc - 32) and d.
void q3_k_block(const uint8_t* block, int8_t* q, int8_t* sc, uint16_t* d) {
  for (int64_t j = 0; j < 256; ++j) {
    const int high_clear = ((block[j % 32] >> (j / 32)) & 1) ^ 1;
    q[j] = static_cast<int8_t>(two_bit(block + 32, j) - (high_clear << 2));
  }
  const uint8_t *low = block + 96, *high = block + 104;
  for (int64_t j = 0; j < 16; ++j) {
    const uint8_t low_bits = j < 8 ? (low[j] & 15) : (low[j - 8] >> 4);
    const uint8_t high_bits = (high[j % 4] >> (2 * (j / 4))) & 3;
    sc[j] = static_cast<int8_t>(static_cast<uint8_t>(low_bits | (high_bits << 4))) - 32;
  }
  std::memcpy(d, block + 108, 2);
}

// One group of 32 float weights as int8 codes round(w / d), d = max|w| / 127 at least
// float16's smallest normal, kept as float16 (rounding as torch's ops round: a division, a
// product, half to even); the codes go to q[4 * (i / 4) * 16 + i % 4], the int8 layout's
// columns of one row. False where d is not finite in float16 or loses more than its 10 bits.
bool int8_group(const float* w, int8_t* q, c10::Half* d16) {
  float top = 0.0f;
  for (int64_t i = 0; i < kGroup; ++i) {
    if (!std::isfinite(w[i])) return false;
    top = std::max(top, std::fabs(w[i]));
  }
  const float d = std::max(top / 127.0f, kFloat16MinNormal);
  *d16 = c10::Half(d);
  const float stored = static_cast<float>(*d16);
  if (!std::isfinite(stored) || std::fabs(stored - d) > std::fabs(d) * 0x1p-10f) return false;
  const float inverse = 1.0f / stored;
  for (int64_t i = 0; i < kGroup; ++i) {
    const float code = std::nearbyint(w[i] * inverse);
    q[(i / 4) * 64 + i % 4] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
  }
  return true;
}

constexpr float kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                  1,    13,   25,  38,  53,  69,  89,  113};

// 32 weights of IQ4 level indices (16 bytes: weight j < 16 the low nibble of byte j, j + 16
// its high one) times their scale.
void iq4_run(const uint8_t* qs, float scale, float* out) {
  for (int64_t j = 0; j < 16; ++j) {
    out[j] = kIQ4Levels[qs[j] & 15] * scale;
    out[j + 16] = kIQ4Levels[qs[j] >> 4] * scale;
  }
}

// An IQ4_XS block of 136 bytes as float32 [256]: per 32 weights the scale d (ls - 32), ls's
// low 4 bits a nibble of bytes 4-7 and its high 2 bits of the uint16 at byte 2.
void iq4_xs_block(const uint8_t* block, float* out) {
  const float d = f16_at(block);
  uint16_t high;
  std::memcpy(&high, block + 2, 2);
  for (int64_t ib = 0; ib < 8; ++ib) {
    const int low = (block[4 + ib / 2] >> (4 * (ib % 2))) & 15;
    const int ls = (low | (((high >> (2 * ib)) & 3) << 4)) - 32;
    iq4_run(block + 8 + 16 * ib, d * static_cast<float>(ls), out + 32 * ib);
  }
}

}  // namespace

at::Tensor iq4_values(const at::Tensor& blocks, bool xs) {
  check_rows(blocks, "blocks", at::kByte);
  const int64_t size = xs ? 136 : 18, weights = xs ? kBlock : kGroup;
  TORCH_CHECK(blocks.size(1) == size, "IQ4 blocks must be [B, ", size, "], got ", blocks.sizes());
  at::Tensor values = at::empty({blocks.size(0), weights}, blocks.options().dtype(at::kFloat));
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  float* out = values.data_ptr<float>();
  at::parallel_for(0, blocks.size(0), 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (xs) {
        iq4_xs_block(in + b * size, out + b * weights);
      } else {
        iq4_run(in + b * size + 2, f16_at(in + b * size), out + b * weights);
      }
    }
  });
  return values;
}

bool quantize_int8_into(const at::Tensor& rows, at::Tensor& codes, at::Tensor& scales,
                        int64_t first_row) {
  check_rows(rows, "rows", at::kFloat);
  const int64_t n = rows.size(0), k = rows.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && codes.is_contiguous() && scales.is_contiguous() &&
                  codes.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf &&
                  codes.dim() == 3 && codes.size(1) == k / 4 && codes.size(2) == 64 &&
                  scales.dim() == 3 && scales.size(1) == groups && scales.size(2) == kTile &&
                  first_row >= 0 && first_row + n <= codes.size(0) * kTile &&
                  scales.size(0) == codes.size(0),
              "int8 layout [T, K / 4, 64] and scales [T, K / 32, 16] must hold rows [", first_row,
              ", ", first_row + n, ") of K = ", k);
  const float* w = rows.data_ptr<float>();
  int8_t* q = codes.data_ptr<int8_t>();
  c10::Half* d = scales.data_ptr<at::Half>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && ok.load(std::memory_order_relaxed); ++i) {
      const int64_t row = first_row + i, tile = row / kTile, c = row % kTile;
      int8_t* tile_codes = q + tile * k * kTile + 4 * c;
      c10::Half* tile_scales = d + tile * groups * kTile + c;
      for (int64_t g = 0; g < groups; ++g) {
        if (!int8_group(w + i * k + g * kGroup, tile_codes + g * 8 * 64, tile_scales + g * kTile)) {
          ok = false;
          break;
        }
      }
    }
  });
  return ok.load();
}

at::Tensor q2_k_values(const at::Tensor& blocks) {
  check_rows(blocks, "blocks", at::kByte);
  TORCH_CHECK(blocks.size(1) == 84, "Q2_K blocks must be [B, 84], got ", blocks.sizes());
  at::Tensor values = at::empty({blocks.size(0), kBlock}, blocks.options().dtype(at::kFloat));
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  float* out = values.data_ptr<float>();
  at::parallel_for(0, blocks.size(0), 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) q2_k_block(in + b * 84, out + b * kBlock);
  });
  return values;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> q3_k_fields(const at::Tensor& blocks) {
  check_rows(blocks, "blocks", at::kByte);
  TORCH_CHECK(blocks.size(1) == 110, "Q3_K blocks must be [B, 110], got ", blocks.sizes());
  const int64_t count = blocks.size(0);
  at::Tensor q = at::empty({count, kBlock}, blocks.options().dtype(at::kChar));
  at::Tensor sc = at::empty({count, 16}, blocks.options().dtype(at::kChar));
  at::Tensor d = at::empty({count, 1}, blocks.options().dtype(at::kHalf));
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  auto *qs = q.data_ptr<int8_t>(), *scs = sc.data_ptr<int8_t>();
  auto* ds = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  at::parallel_for(0, count, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      q3_k_block(in + b * 110, qs + b * kBlock, scs + b * 16, ds + b);
    }
  });
  return {q, sc, d};
}

at::Tensor k_quant_codes(const at::Tensor& blocks, bool five) {
  check_rows(blocks, "blocks", at::kByte);
  TORCH_CHECK(blocks.size(1) == (five ? 176 : 144), "K-quant blocks must be [B, ",
              five ? 176 : 144, "], got ", blocks.sizes());
  const int64_t count = blocks.size(0), size = blocks.size(1);
  at::Tensor codes = at::empty({count, 8, kGroup}, blocks.options());
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  at::parallel_for(0, count, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) k_quant_block(in + b * size, five, out + b * kBlock);
  });
  return codes;
}

at::Tensor pack_int4_codes(const at::Tensor& codes, bool five) {
  check_rows(codes, "codes", at::kByte);
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(n % kTile == 0 && k % kGroup == 0, "codes must be [16 n, 32 g], got ", codes.sizes());
  const int64_t chunks = five ? k / kGroup * 5 : k / 8;
  at::Tensor out = at::empty({n / kTile, chunks, 64}, codes.options());
  const uint8_t* in = codes.data_ptr<uint8_t>();
  uint8_t* packed = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
    pack_int4_tiles(in, packed, k, five, begin, end);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> q6_k_fields(const at::Tensor& rows) {
  check_rows(rows, "rows", at::kByte);
  const int64_t n = rows.size(0), count = rows.size(1) / kQ6KBytes;
  TORCH_CHECK(rows.size(1) % kQ6KBytes == 0, "Q6_K rows must be whole blocks of 210 bytes");
  at::Tensor codes = at::empty({n, count * kBlock}, rows.options());
  at::Tensor sc = at::empty({n, count * 16}, rows.options().dtype(at::kChar));
  at::Tensor d = at::empty({n, count}, rows.options().dtype(at::kHalf));
  const uint8_t* in = rows.data_ptr<uint8_t>();
  auto* q = codes.data_ptr<uint8_t>();
  auto* s = sc.data_ptr<int8_t>();
  auto* dd = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      q6_k_row(in + i * count * kQ6KBytes, count, q + i * count * kBlock, s + i * count * 16,
               dd + i * count);
    }
  });
  return {codes, sc, d};
}

std::tuple<at::Tensor, at::Tensor> pack_six_bit(const at::Tensor& codes, const at::Tensor& sc,
                                                const at::Tensor& d) {
  check_rows(codes, "codes", at::kByte);
  check_rows(sc, "sc", at::kChar);
  check_rows(d, "d", at::kHalf);
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kBlock == 0 && sc.size(0) == n && sc.size(1) == k / 16 && d.size(0) == n &&
                  d.size(1) == k / kBlock,
              "six-bit fields must be codes [N, 256 b], sc [N, 16 b] and d [N, b]");
  const int64_t tiles = (n + kTile - 1) / kTile;
  at::Tensor packed = at::zeros({tiles, k / kGroup * 6, 64}, codes.options());
  at::Tensor scales = at::zeros({tiles, k / kBlock, 288}, codes.options());
  const auto* dd = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    pack_six_bit_tiles(codes.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), dd, n, k,
                       packed.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), begin, end);
  });
  return {packed, scales};
}

std::tuple<at::Tensor, at::Tensor> pack_two_bit(const at::Tensor& rows) {
  check_rows(rows, "rows", at::kByte);
  TORCH_CHECK(rows.size(1) % kQ2KBytes == 0, "Q2_K rows must be whole blocks of 84 bytes");
  const int64_t n = rows.size(0), blocks = rows.size(1) / kQ2KBytes;
  const int64_t tiles = (n + kTile - 1) / kTile;
  at::Tensor packed = at::zeros({tiles, blocks * 16, 64}, rows.options());
  at::Tensor scales = at::zeros({tiles, blocks, 320}, rows.options());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    pack_two_bit_tiles(rows.data_ptr<uint8_t>(), n, blocks, packed.data_ptr<uint8_t>(),
                       scales.data_ptr<uint8_t>(), begin, end);
  });
  return {packed, scales};
}

}  // namespace strata_native

// Packing at load: a weight's codes into the layouts of Strata's int4 and 6-bit products
// (quantized_mm.cpp, quantized_mm6.cpp), and a GGUF Q6_K weight's fields out of its blocks. Each
// is one pass over the weight, tiles of 16 rows in parallel; replicas/model/quant.py and
// replicas/model/six_bit.py hold the same packing written in torch ops, which the tests compare
// these with byte for byte.

#include "weight_packing.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace strata_native {
namespace {

constexpr int64_t kTile = 16;      // rows per tile
constexpr int64_t kGroup = 32;     // columns per group
constexpr int64_t kBlock = 256;    // columns per Q6_K block (and per 6-bit D)
constexpr int64_t kQ6KBytes = 210; // a Q6_K block: ql[128], qh[64], sc[16] (int8), d (float16)

void check_rows(const at::Tensor& t, const char* what, at::ScalarType type) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == type,
              what, " must be a contiguous 2-d CPU tensor of ", type);
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
        for (int64_t o = 0; o < 4; ++o) {
          for (int64_t r = 0; r < 4; ++r) {
            group[o * 64 + r] = (q[8 * o + r] & 15) | ((q[8 * o + 4 + r] & 15) << 4);
          }
        }
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
        for (int64_t o = 0; o < 4; ++o) {
          for (int64_t r = 0; r < 4; ++r) {
            group[o * 64 + r] = (x[8 * o + r] & 15) | ((x[8 * o + 4 + r] & 15) << 4);
          }
        }
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

}  // namespace

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

}  // namespace strata_native

// Packing at load (weight_packing.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace strata_native {

// Codes [N, K] (uint8; N a multiple of 16, K of 32) in the int4 product's chunks:
// [N / 16, K / 8, 64], or with `five` (codes up to 31) [N / 16, K / 32 * 5, 64].
at::Tensor pack_int4_codes(const at::Tensor& codes, bool five);

// GGUF Q4_K blocks [B, 144] (or, with `five`, Q5_K ones [B, 176]) as their codes [B, 8, 32]
// (uint8; group, weight), a Q5_K code's fifth bit included.
at::Tensor k_quant_codes(const at::Tensor& blocks, bool five);

// GGUF Q6_K rows [N, K / 256 * 210] (uint8) as codes [N, K] (uint8 in [0, 63]), sc [N, K / 16]
// (int8) and D [N, K / 256] (float16).
std::tuple<at::Tensor, at::Tensor, at::Tensor> q6_k_fields(const at::Tensor& rows);

// Those fields in the 6-bit product's layout: codes [ceil(N / 16), K / 32 * 6, 64] and scales
// [ceil(N / 16), K / 256, 288] (uint8), rows past N zeros.
std::tuple<at::Tensor, at::Tensor> pack_six_bit(const at::Tensor& codes, const at::Tensor& sc,
                                                const at::Tensor& d);

// GGUF Q2_K rows [N, K / 256 * 84] (uint8) in the 2-bit product's layout (quantized_mm2.cpp):
// codes [ceil(N / 16), K / 32 * 2, 64] and scales [ceil(N / 16), K / 256, 320] (uint8), rows
// past N zeros.
std::tuple<at::Tensor, at::Tensor> pack_two_bit(const at::Tensor& rows);

// GGUF Q2_K blocks [B, 84] as float32 [B, 256], bit for bit gguf_dequantize._q2_k's values.
at::Tensor q2_k_values(const at::Tensor& blocks);

// GGUF IQ4_NL blocks [B, 18] as float32 [B, 32], or (`xs`) IQ4_XS blocks [B, 136] as float32
// [B, 256], bit for bit gguf_dequantize's values.
at::Tensor iq4_values(const at::Tensor& blocks, bool xs);

// GGUF Q3_K blocks [B, 110] as their codes [B, 256] (int8 in [-4, 3]), scales [B, 16] (int8)
// and d [B, 1] (float16), as gguf_dequantize.q3_k_fields takes them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> q3_k_fields(const at::Tensor& blocks);

// Float32 rows [R, K] as int8 codes round(w / d) and float16 steps d = max|w| / 127 (at least
// float16's smallest normal) per group of 32 (quant.py's _strata_int8), written as rows
// first_row.. of the int8 layout: codes [T, K / 4, 64], scales [T, K / 32, 16]. False (the
// layout partly written) where a step is not a float16 of its full precision.
bool quantize_int8_into(const at::Tensor& rows, at::Tensor& codes, at::Tensor& scales,
                        int64_t first_row);

}  // namespace strata_native

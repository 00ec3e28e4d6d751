// Strata's quantized products (quantized_mm.cpp).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace strata_native {

// The path the products take for `requested` (-1: the best this CPU has; else at most that;
// native_isa.h's kPath*).
int64_t quantized_mm_path(int64_t requested);

// x [M, K] (float32, bfloat16 or float16) times a packed weight [out_features, K] transposed:
// float32 [M, out_features] (layouts: quantized_mm.cpp, quantized_mm6.cpp).
// - int4: codes uint8 [N / 16, K / 8, 64], or [N / 16, K / 32 * 5, 64] for 5-bit codes; scales
//   float16 [N / 16, K / 32, 2, 16] (d, m), or uint8 [N / 16, K / 256, 320] (a Q4_K or Q5_K
//   weight's as stored); or a GGUF Q2_K weight as stored: codes uint8 [N / 16, K / 32 * 2, 64],
//   scales uint8 [N / 16, K / 256, 320].
// - int8: codes int8 [N / 16, K / 4, 64], scales float16 [N / 16, K / 32, 16] (d); or a GGUF
//   Q6_K weight as stored: codes uint8 [N / 16, K / 32 * 6, 64], scales uint8
//   [N / 16, K / 256, 288].
// `passes`: the activations' int8 passes, 1 or 2; `path` as for quantized_mm_path.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t out_features, int64_t passes, int64_t path);
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t out_features, int64_t passes, int64_t path);

// x times several weights of different layouts at once, their rows one after the other (a fused
// q/k/v product whose weights a file stores in different types): the activations quantized once
// and one parallel loop over every weight's tiles, each row's result bitwise that of int4_mm or
// int8_mm on each weight (int4[i] names which takes weight i). Every weight but the last has a
// multiple of 16 rows.
at::Tensor mixed_mm(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                    const std::vector<at::Tensor>& scales, const std::vector<int64_t>& int4,
                    const std::vector<int64_t>& out_features, int64_t passes, int64_t path);

}  // namespace strata_native

// Strata's int4 product (int4_kernel.cpp).
#pragma once

#include <ATen/ATen.h>

namespace strata_native {

// The instruction paths of int4_mm, each also allowing the ones below it.
constexpr int64_t kPathScalar = 0;
constexpr int64_t kPathAvx2 = 1;
constexpr int64_t kPathAvx512Vnni = 2;

// The path int4_mm takes for `requested` (-1: the best this CPU has; else at most that).
int64_t int4_path(int64_t requested);

// x [M, K] (float32, bfloat16 or float16) times the packed int4 weight [out_features, K]
// transposed: float32 [M, out_features].
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t out_features, int64_t path);

}  // namespace strata_native

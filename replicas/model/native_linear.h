// A product of the native decoder stack (native_stack.cpp): nn.Linear, QuantizedLinear.forward
// or MixedLinear.forward on a CPU, read from the stack's packed arguments
// (replicas/model/native_stack.py's _pack).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "quantized_mm.h"

namespace strata_native {

// replicas/model/native_stack.py's _KINDS
enum LinearKind : int64_t {
  kDense = 0, kInt8 = 1, kInt4 = 2, kInt4Strata = 3, kInt8Strata = 4, kMixedStrata = 5
};
constexpr int64_t kInt4GroupSize = 32;  // replicas.model.quant.GROUP_SIZE

struct Linear {
  int64_t kind = kDense;
  int64_t in_features = 0;
  int64_t out_features = 0;
  int64_t passes = 2;  // the activations' int8 passes of Strata's products
  at::Tensor weight, scales, bias;
  // kMixedStrata: each weight's codes, scales, product (1: int4_mm, 0: int8_mm) and rows
  std::vector<at::Tensor> part_codes, part_scales;
  std::vector<int64_t> part_int4, part_rows;

  // Reads one product as _pack lays it out: kind, in and out features, whether it has a bias,
  // passes; for a mixed product the number of its weights and each one's int4 flag and rows;
  // then the weight and scales (each weight's, for a mixed product) and the bias.
  template <typename NextInt, typename NextTensor>
  static Linear read(NextInt& next_int, NextTensor& next_tensor) {
    Linear l;
    l.kind = next_int();
    l.in_features = next_int();
    l.out_features = next_int();
    const bool has_bias = next_int();
    l.passes = next_int();
    if (l.kind == kMixedStrata) {
      const int64_t parts = next_int();
      for (int64_t i = 0; i < parts; ++i) {
        l.part_int4.push_back(next_int());
        l.part_rows.push_back(next_int());
        l.part_codes.push_back(next_tensor());
        l.part_scales.push_back(next_tensor());
      }
    } else {
      l.weight = next_tensor();
      if (l.kind != kDense) l.scales = next_tensor();
    }
    if (has_bias) l.bias = next_tensor();
    return l;
  }

  // Whether the product is torch's packed kernel, which takes bfloat16 rows.
  bool packed() const { return kind == kInt8 || kind == kInt4; }

  // The product in x's dtype; or, with out_dtype, rounded to that instead (a packed product's
  // bfloat16 result kept for a sum in float32, which widens it exactly as .to(float32) would).
  at::Tensor operator()(const at::Tensor& x,
                        std::optional<at::ScalarType> out_dtype = std::nullopt) const {
    if (kind == kDense) {
      at::Tensor y =
          at::linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
      return out_dtype ? y.to(*out_dtype) : y;
    }
    auto shape = x.sizes().vec();
    shape.back() = out_features;
    if (kind == kInt4Strata || kind == kInt8Strata || kind == kMixedStrata) {
      // read x as it is and return float32
      const at::Tensor rows = x.reshape({-1, in_features});
      at::Tensor y = kind == kMixedStrata
          ? mixed_mm(rows, part_codes, part_scales, part_int4, part_rows, passes, /*path=*/-1)
          : (kind == kInt4Strata ? int4_mm : int8_mm)(rows, weight, scales, out_features, passes,
                                                      /*path=*/-1);
      if (bias.defined()) y = at::add(y, bias);
      return y.to(out_dtype.value_or(x.scalar_type())).reshape(shape);
    }
    at::Tensor rows = x.reshape({-1, in_features}).to(at::kBFloat16);  // no-op if bfloat16
    at::Tensor y = kind == kInt8
        ? at::_weight_int8pack_mm(rows, weight, scales)
        : at::_weight_int4pack_mm_for_cpu(rows, weight, kInt4GroupSize, scales);
    if (bias.defined()) y = at::add(y, bias);
    return y.to(out_dtype.value_or(x.scalar_type())).reshape(shape);
  }
};

// The dtype a product's input is rounded to first: bfloat16 for packed products (their
// QuantizedLinear.forward starts with .to(bfloat16)), else the model's.
inline at::ScalarType input_dtype(const std::vector<Linear>& linears, at::ScalarType model) {
  for (const Linear& l : linears) {
    if (!l.packed()) return model;
  }
  return at::kBFloat16;
}

// The dtype a product's result is left in for the residual sum: a packed product's bfloat16
// in a float32 model (the sum widens it exactly, as .to(float32) would), else the model's.
inline at::ScalarType sum_dtype(const Linear& l, at::ScalarType model) {
  return l.packed() && model == at::kFloat ? at::kBFloat16 : model;
}

}  // namespace strata_native

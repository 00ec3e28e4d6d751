// The decoder stack of replicas/model/transformer.py as one C++ loop over the same ATen ops.
//
// Each function here mirrors its Python counterpart op for op, in the same order and with the
// same arguments, so that the outputs are bitwise those of the eager model: RMSNorm.forward,
// apply_rope, Attention.forward with cached_attention and _attend for a KV cache of values,
// FeedForward.forward, QuantizedLinear.forward and MixedLinear.forward (native_linear.h) and
// TransformerBlock.forward. A change to one of them must be made to both
// (tests/unit/model/test_native_stack.py compares them bitwise). The attention plan it reads is
// attention_plan.h's.
// RMSNorm, the rotary embedding and the KV write run as fused passes over rows that round
// exactly where the op chains round (see fused_rms_norm); a packed product's bfloat16 input
// and output are kept in bfloat16 where the next op widens them exactly anyway.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "decode_attention.h"
#include "attention_plan.h"
#include "native_linear.h"
#include "quantized_mm.h"
#include "weight_packing.h"

namespace {

// Fused elementwise passes. Each replaces a chain of ATen ops with one loop that rounds exactly
// where the chain rounds: every step of the chain is one correctly rounded operation per
// element (products, sums, quotients, square roots, conversions to the tensor's dtype, the
// reduced types computing in float and rounding once, as ATen's kernels do), and the library
// is compiled with -ffp-contract=off so that no product and sum are fused. The one step whose
// rounding depends on the CPU, RMSNorm's sum over the hidden dimension, is ATen's own at::sum.

// The passes are plain loops over rows, which are independent: a decode row or a few run on
// one thread (where ATen's per-op cost would dominate), a batch or a prefill chunk on torch's
// threads, kFusedGrain elements or more to a task. Either way one pass replaces the chain's
// several over memory, each writing a new tensor.
constexpr int64_t kFusedGrain = 16384;

// for_rows(n, width, f): f(begin, end) over rows [0, n) of `width` elements, in parallel.
template <typename F>
void for_rows(int64_t num_rows, int64_t width, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kFusedGrain / std::max<int64_t>(width, 1));
  at::parallel_for(0, num_rows, grain, f);
}

bool fusable_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// A CPU tensor of a fusable dtype with unit stride in its last dimension, and a partner of the
// same dtype.
bool fusable(const at::Tensor& x, const at::Tensor& other) {
  return x.device().is_cpu() && fusable_dtype(x.scalar_type()) &&
         other.scalar_type() == x.scalar_type() && other.device().is_cpu() && x.dim() >= 2 &&
         x.stride(-1) == 1 && x.size(-1) % 2 == 0;
}

template <typename scalar_t>
inline scalar_t round_to(float v) {
  return static_cast<scalar_t>(v);  // float: exact; BFloat16 and Half: round to nearest even
}

// Row r of x (any shape, last dimension contiguous) as a pointer, for rows in row-major order.
template <typename scalar_t>
struct Rows {
  const scalar_t* base;
  std::vector<int64_t> sizes, strides;  // of the dimensions before the last
  explicit Rows(const at::Tensor& x) : base(x.const_data_ptr<scalar_t>()) {
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      sizes.push_back(x.size(d));
      strides.push_back(x.stride(d));
    }
  }
  const scalar_t* operator[](int64_t r) const {
    int64_t offset = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      offset += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return base + offset;
  }
};

// weight * F.rms_norm(x, eps) rounded to out_dtype. ATen's rms_norm computes in float:
// pow(x, 2) (x * x), mean over the last dimension (at::sum, then divided by its size), add_(eps),
// rsqrt (1 / sqrt), x times it, rounded to x's dtype; the weight product is then one more
// rounded product in x's dtype.
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                          at::ScalarType out_dtype) {
  RECORD_FUNCTION("strata_native::fused_rms_norm", std::vector<c10::IValue>());
  const int64_t dim = x.size(-1), num_rows = x.numel() / dim;
  at::Tensor squares = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const Rows<scalar_t> rows(x);
    float* sq = squares.mutable_data_ptr<float>();
    for_rows(num_rows, dim, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = rows[r];
        for (int64_t i = 0; i < dim; ++i) {
          const float v = static_cast<float>(row[i]);
          sq[r * dim + i] = v * v;
        }
      }
    });
    const at::Tensor sums = at::sum(squares, {-1}, /*keepdim=*/true).contiguous();
    const float* sum = sums.const_data_ptr<float>();
    const scalar_t* w = weight.contiguous().const_data_ptr<scalar_t>();
    const float size = static_cast<float>(dim), epsilon = static_cast<float>(eps);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "rms_norm_out", [&] {
      using out_t = scalar_t;
      out_t* o = out.mutable_data_ptr<out_t>();
      for_rows(num_rows, dim, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const float inverse = 1.0f / std::sqrt(sum[r] / size + epsilon);
          const auto* row = rows[r];
          for (int64_t i = 0; i < dim; ++i) {
            using in_t = std::remove_cv_t<std::remove_pointer_t<decltype(row)>>;
            const in_t normed = round_to<in_t>(static_cast<float>(row[i]) * inverse);
            const in_t scaled =
                round_to<in_t>(static_cast<float>(w[i]) * static_cast<float>(normed));
            o[r * dim + i] = round_to<out_t>(static_cast<float>(scaled));
          }
        }
      });
    });
  });
  return out;
}

// apply_rope: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to x's dtype.
// x: [T, heads, D] with a contiguous last dimension; cos, sin: [T, 1, D], contiguous.
at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  RECORD_FUNCTION("strata_native::fused_rope", std::vector<c10::IValue>());
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t dim = x.size(-1), half = dim / 2, heads = x.numel() / (x.size(0) * dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    const Rows<scalar_t> rows(x);
    const scalar_t* c = cos.const_data_ptr<scalar_t>();
    const scalar_t* s = sin.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    auto f = [](scalar_t v) { return static_cast<float>(v); };
    for_rows(x.size(0) * heads, dim, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = rows[r];
        const scalar_t* ct = c + (r / heads) * dim;
        const scalar_t* st = s + (r / heads) * dim;
        scalar_t* out_row = o + r * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = f(row[i]), b = f(row[i + half]);
          out_row[i] = round_to<scalar_t>(f(round_to<scalar_t>(a * f(ct[i]))) +
                                          f(round_to<scalar_t>(-b * f(st[i]))));
          out_row[i + half] =
              round_to<scalar_t>(f(round_to<scalar_t>(b * f(ct[i + half]))) +
                                 f(round_to<scalar_t>(a * f(st[i + half]))));
        }
      }
    });
  });
  return out;
}

// rows.index_copy_(0, write_rows, cat({k, v}).view({-1, D}).to(rows' dtype)): each new token's
// K and V rows converted to the cache's dtype (to nearest even, as .to rounds) and written to
// their cache rows. k, v: [T, kv heads, D] with a contiguous last dimension.
void write_kv(at::Tensor& rows, const at::Tensor& write_rows, const at::Tensor& k,
              const at::Tensor& v) {
  RECORD_FUNCTION("strata_native::write_kv", std::vector<c10::IValue>());
  const int64_t dim = k.size(-1), per_tensor = k.numel() / dim;
  const int64_t* targets = write_rows.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    using in_t = scalar_t;
    const Rows<in_t> sources[2] = {Rows<in_t>(k), Rows<in_t>(v)};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "write_kv_to", [&] {
      scalar_t* cache = rows.mutable_data_ptr<scalar_t>();
      for_rows(2 * per_tensor, dim, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const in_t* from = sources[i / per_tensor][i % per_tensor];
          TORCH_CHECK(targets[i] >= 0 && targets[i] < rows.size(0), "write_kv: cache row ",
                      targets[i], " out of ", rows.size(0));
          scalar_t* to = cache + targets[i] * dim;
          for (int64_t j = 0; j < dim; ++j) to[j] = static_cast<scalar_t>(static_cast<float>(from[j]));
        }
      });
    });
  });
}

using strata_native::Chunk;
using strata_native::Group;
using strata_native::Linear;
using strata_native::unpack_groups;

struct Layer {
  std::vector<Linear> qkv;  // one fused product, or q, k and v
  Linear wo;
  std::vector<Linear> gate_up;  // one fused product, or gate and up
  Linear w2;
  at::Tensor attention_norm, ffn_norm, q_norm, k_norm;  // q_norm, k_norm: Qwen3's, or undefined
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  // tensors and ints as replicas/model/native_stack.py's _pack lays them out.
  DecoderStack(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, double eps)
      : eps_(eps) {
    size_t t = 0, i = 0;
    auto next_int = [&] { return ints.at(i++); };
    auto next_tensor = [&] { return tensors.at(t++); };
    const int64_t num_layers = next_int();
    num_heads_ = next_int();
    num_kv_heads_ = next_int();
    head_dim_ = next_int();
    auto linear = [&] { return Linear::read(next_int, next_tensor); };
    for (int64_t n = 0; n < num_layers; ++n) {
      Layer layer;
      const int64_t num_qkv = next_int(), num_gate_up = next_int(), has_qk_norm = next_int();
      for (int64_t j = 0; j < num_qkv; ++j) layer.qkv.push_back(linear());
      layer.wo = linear();
      for (int64_t j = 0; j < num_gate_up; ++j) layer.gate_up.push_back(linear());
      layer.w2 = linear();
      layer.attention_norm = next_tensor();
      layer.ffn_norm = next_tensor();
      if (has_qk_norm) {
        layer.q_norm = next_tensor();
        layer.k_norm = next_tensor();
      }
      layers_.push_back(std::move(layer));
    }
    norm_ = next_tensor();
    TORCH_CHECK(t == tensors.size() && i == ints.size(), "DecoderStack: unread arguments");
  }

  // run_layers: write_rows is the layout's rows of layer 0 for the new tokens' K/V, and
  // group_ints / group_tensors describe its attention groups as _attention_plan packs them.
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& kv_cache, const at::Tensor& write_rows,
                     bool is_one_group, const std::vector<int64_t>& group_ints,
                     const std::vector<at::Tensor>& group_tensors) const {
    const std::vector<Group> groups = unpack_groups(group_ints, group_tensors);
    const int64_t row_width = kv_cache.size(-1);
    const int64_t layer_rows = kv_cache.stride(1) / row_width;
    const at::Tensor cache_rows = kv_cache.view({-1, row_width});
    for (size_t n = 0; n < layers_.size(); ++n) {
      const Layer& layer = layers_[n];
      at::Tensor rows = cache_rows.slice(0, static_cast<int64_t>(n) * layer_rows);
      const auto dtype = x.scalar_type();
      at::Tensor normed = rms_norm(x, layer.attention_norm, input_dtype(layer.qkv, dtype));
      x = at::add(x, attention(layer, normed, dtype, cos, sin, rows, write_rows, is_one_group,
                               groups));
      normed = rms_norm(x, layer.ffn_norm, input_dtype(layer.gate_up, dtype));
      x = at::add(x, feed_forward(layer, normed, dtype));
    }
    return rms_norm(x, norm_);
  }

 private:
  // RMSNorm.forward, then rounded to out_dtype (a packed product's bfloat16 input: the
  // .to(bfloat16) QuantizedLinear.forward starts with). See fused_rms_norm.
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight,
                      std::optional<at::ScalarType> out_dtype = std::nullopt) const {
    const auto out = out_dtype.value_or(x.scalar_type());
    if (fusable(x, weight) && fusable_dtype(out)) {
      return fused_rms_norm(x, weight, eps_, out);
    }
    at::Tensor y = at::mul(weight, at::rms_norm(x, {x.size(-1)}, std::nullopt, eps_));
    return out_dtype ? y.to(*out_dtype) : y;
  }

  static at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    if (fusable(x, cos) && fusable(x, sin) && cos.is_contiguous() && sin.is_contiguous() &&
        cos.size(-1) == x.size(-1) && cos.numel() == x.size(0) * x.size(-1)) {
      return fused_rope(x, cos, sin);
    }
    auto halves = x.chunk(2, -1);
    return at::add(at::mul(x, cos), at::mul(at::cat({at::neg(halves[1]), halves[0]}, -1), sin));
  }

  // Attention.forward of the normed x (in the qkv products' input dtype, see input_dtype), for
  // a model of dtype. The output product's result is left in its own dtype for the residual sum.
  at::Tensor attention(const Layer& layer, const at::Tensor& x, at::ScalarType dtype,
                       const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor& rows, const at::Tensor& write_rows,
                       bool is_one_group, const std::vector<Group>& groups) const {
    const int64_t num_tokens = x.size(0);
    at::Tensor q, k, v;
    if (layer.qkv.size() == 1 && !layer.q_norm.defined()) {
      at::Tensor qkv = layer.qkv[0](x, dtype);
      const int64_t qk_dim = (num_heads_ + num_kv_heads_) * head_dim_;
      at::Tensor qk =
          qkv.slice(1, 0, qk_dim).view({num_tokens, num_heads_ + num_kv_heads_, head_dim_});
      auto split = rope(qk, cos, sin).split_with_sizes({num_heads_, num_kv_heads_}, 1);
      q = split[0];
      k = split[1];
      v = qkv.slice(1, qk_dim).view({num_tokens, num_kv_heads_, head_dim_});
    } else {
      if (layer.qkv.size() == 3) {
        q = layer.qkv[0](x, dtype);
        k = layer.qkv[1](x, dtype);
        v = layer.qkv[2](x, dtype);
      } else {
        auto split = layer.qkv[0](x, dtype).split_with_sizes(
            {num_heads_ * head_dim_, num_kv_heads_ * head_dim_, num_kv_heads_ * head_dim_}, -1);
        q = split[0];
        k = split[1];
        v = split[2];
      }
      q = q.view({num_tokens, num_heads_, head_dim_});
      k = k.view({num_tokens, num_kv_heads_, head_dim_});
      v = v.view({num_tokens, num_kv_heads_, head_dim_});
      if (layer.q_norm.defined()) {
        q = rms_norm(q, layer.q_norm);
        k = rms_norm(k, layer.k_norm);
      }
      q = rope(q, cos, sin);
      k = rope(k, cos, sin);
    }
    // cached_attention: the new tokens' K/V into the cache, then each group attends.
    if (fusable(k, v) && fusable_dtype(rows.scalar_type()) && rows.is_contiguous() &&
        write_rows.scalar_type() == at::kLong && write_rows.is_contiguous() &&
        write_rows.numel() * head_dim_ == 2 * k.numel()) {
      write_kv(rows, write_rows, k, v);
    } else {
      rows.index_copy_(0, write_rows, at::cat({k, v}).view({-1, head_dim_}).to(rows.scalar_type()));
    }
    at::Tensor out;
    if (is_one_group) {
      out = attend(q, rows, groups[0]);
    } else {
      out = at::empty_like(q);
      for (const Group& g : groups) {
        if (g.rows_are_slice) {
          out.slice(0, g.row_start, g.row_end).copy_(attend(q.slice(0, g.row_start, g.row_end), rows, g));
        } else {
          out.index_put_({g.row_index}, attend(q.index({g.row_index}), rows, g));
        }
      }
    }
    const at::Tensor attended = out.reshape({num_tokens, -1});
    return layer.wo(attended, sum_dtype(layer.wo, dtype));
  }

  // attention._attend for a KV cache of values.
  at::Tensor attend(const at::Tensor& q, const at::Tensor& rows, const Group& g) const {
    const int64_t heads_per_kv = num_heads_ / num_kv_heads_;
    const int64_t num_seqs = g.num_seqs, q_len = g.q_len;
    const auto dtype = q.scalar_type();
    if (g.chunks.size() == 1) {
      if (head_dim_ % 16 == 0) {  // Strata's attention (decode_attention.h)
        if (q_len == 1) {
          return strata_native::decode_attention(q.reshape({num_seqs, num_heads_, head_dim_}),
                                                 rows, g.chunks[0].rows, g.allowed, num_kv_heads_, -1);
        }
        return strata_native::rows_attention(q.reshape({num_seqs * q_len, num_heads_, head_dim_}),
                                             rows, g.chunks[0].rows, g.allowed, g.is_causal,
                                             q_len, num_kv_heads_, -1, -1);
      }
      auto kv = rows.index_select(0, g.chunks[0].rows)
                    .to(dtype)
                    .view({2, num_seqs, num_kv_heads_, -1, head_dim_})
                    .unbind(0);
      if (q_len == 1) {  // decodes: the query rows of each kv head side by side, no GQA expand
        at::Tensor o = at::scaled_dot_product_attention(
            q.reshape({num_seqs, num_kv_heads_, heads_per_kv, head_dim_}).to(dtype), kv[0], kv[1],
            g.allowed);
        return o.view({num_seqs, num_heads_, head_dim_}).to(dtype);
      }
      at::Tensor o = at::scaled_dot_product_attention(
          q.reshape({num_seqs, q_len, num_heads_, head_dim_}).transpose(1, 2).to(dtype), kv[0],
          kv[1], g.allowed, 0.0, g.is_causal, std::nullopt, /*enable_gqa=*/true);
      return o.transpose(1, 2).reshape({num_seqs * q_len, num_heads_, head_dim_}).to(dtype);
    }
    // Chunks combined by an online softmax in base 2 (attention.py's module docstring).
    at::Tensor qg = q.reshape({num_seqs, q_len, num_kv_heads_, heads_per_kv, head_dim_})
                        .transpose(1, 2)
                        .reshape({num_seqs * num_kv_heads_, q_len * heads_per_kv, head_dim_});
    qg = at::mul(qg.to(at::kFloat), std::log2(M_E) / std::sqrt(double(head_dim_)));
    for (const Chunk& c : g.chunks) {
      const int64_t n = c.num_seqs * num_kv_heads_;
      auto kv = rows.index_select(0, c.rows).to(at::kFloat).view({2, n, -1, head_dim_}).unbind(0);
      at::Tensor s = at::bmm(qg.slice(0, 0, n).slice(1, c.query_start, c.query_end),
                             kv[0].transpose(1, 2));
      if (c.bias.defined()) {
        s.view({c.num_seqs, num_kv_heads_, -1, s.size(-1)}).add_(c.bias);
      }
      at::Tensor max_score = c.max_score, sum_exp = c.sum_exp, acc = c.acc;  // views
      at::amax_out(max_score, s, {-1}, true);
      at::Tensor p = s.sub_(max_score).exp2_();
      at::sum_out(sum_exp, p, {-1}, true);
      at::bmm_out(acc, p, kv[1]);
    }
    at::Tensor weights = at::sub(g.m_all, g.m_all.amax(0)).exp2_();  // 2^(m_c - M)
    at::Tensor out = at::div(at::mul(g.o_all, weights).sum(0), at::mul(g.l_all, weights).sum(0));
    out = out.view({num_seqs, num_kv_heads_, q_len, heads_per_kv, head_dim_}).transpose(1, 2);
    return out.reshape({num_seqs * q_len, num_heads_, head_dim_}).to(dtype);
  }

  // FeedForward.forward of the normed x (as in attention), for a model of dtype.
  static at::Tensor feed_forward(const Layer& layer, const at::Tensor& x, at::ScalarType dtype) {
    if (layer.gate_up.size() == 1) {
      auto gate_up = layer.gate_up[0](x, dtype).chunk(2, -1);
      return layer.w2(at::mul(at::silu(gate_up[0]), gate_up[1]), sum_dtype(layer.w2, dtype));
    }
    return layer.w2(
        at::mul(at::silu(layer.gate_up[0](x, dtype)), layer.gate_up[1](x, dtype)), sum_dtype(layer.w2, dtype));
  }

  std::vector<Layer> layers_;
  at::Tensor norm_;
  int64_t num_heads_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  double eps_;
};

}  // namespace

TORCH_LIBRARY(strata_native, m) {
  m.def("int4_mm(Tensor x, Tensor codes, Tensor scales, int out_features, int passes=2, "
        "int path=-1) -> Tensor",
        &strata_native::int4_mm);
  m.def("int8_mm(Tensor x, Tensor codes, Tensor scales, int out_features, int passes=2, "
        "int path=-1) -> Tensor",
        &strata_native::int8_mm);
  m.def("mixed_mm(Tensor x, Tensor[] codes, Tensor[] scales, int[] int4, int[] out_features, "
        "int passes=2, int path=-1) -> Tensor",
        &strata_native::mixed_mm);
  m.def("quantized_mm_path(int requested=-1) -> int", &strata_native::quantized_mm_path);
  m.def("decode_attention(Tensor q, Tensor cache_rows, Tensor rows, Tensor? allowed, "
        "int num_kv_heads, int path=-1) -> Tensor",
        &strata_native::decode_attention);
  m.def("rows_attention(Tensor q, Tensor cache_rows, Tensor rows, Tensor? allowed, bool is_causal, "
        "int q_len, int num_kv_heads, int path=-1, int wave_bytes=-1) -> Tensor",
        &strata_native::rows_attention);
  m.def("decode_attention_path(int requested=-1) -> int", &strata_native::decode_attention_path);
  m.def("iq4_values(Tensor blocks, bool xs) -> Tensor", &strata_native::iq4_values);
  m.def("q2_k_values(Tensor blocks) -> Tensor", &strata_native::q2_k_values);
  m.def("q3_k_fields(Tensor blocks) -> (Tensor, Tensor, Tensor)", &strata_native::q3_k_fields);
  m.def("quantize_int8_into(Tensor rows, Tensor(a!) codes, Tensor(b!) scales, int first_row) "
        "-> bool",
        &strata_native::quantize_int8_into);
  m.def("k_quant_codes(Tensor blocks, bool five) -> Tensor", &strata_native::k_quant_codes);
  m.def("pack_int4_codes(Tensor codes, bool five) -> Tensor", &strata_native::pack_int4_codes);
  m.def("q6_k_fields(Tensor rows) -> (Tensor, Tensor, Tensor)", &strata_native::q6_k_fields);
  m.def("pack_six_bit(Tensor codes, Tensor sc, Tensor d) -> (Tensor, Tensor)",
        &strata_native::pack_six_bit);
  m.def("pack_two_bit(Tensor rows) -> (Tensor, Tensor)", &strata_native::pack_two_bit);
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double>())
      .def("forward", &DecoderStack::forward);
}

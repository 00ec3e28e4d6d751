// Strata's decode attention (decode_attention.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace strata_native {

// The path decode_attention takes for `requested` (-1: the best this CPU has; else at most that;
// native_isa.h's kPath*).
int64_t decode_attention_path(int64_t requested);

// One query per sequence against its keys, read in place from a KV cache of values:
// q [S, H, D] (any float dtype), cache_rows [R, D] (float32, bfloat16 or float16; a layer's
// rows), rows [2 * S * num_kv_heads * W] int64 (the cache rows of each sequence's and kv head's
// W keys, then of its values: attention._GroupReads), allowed [S, 1, 1, W] bool or none (True:
// the key is seen). Returns [S, H, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache_rows,
                            const at::Tensor& rows, const std::optional<at::Tensor>& allowed,
                            int64_t num_kv_heads, int64_t path);

// q_len query rows per sequence against its keys, with the arithmetic decode_attention gives
// each row as a decode over the keys it sees (so bitwise the same): q [S * q_len, H, D],
// sequence-major; allowed [S, 1, q_len, W] bool or none (then causal: row l sees keys
// j <= W - q_len + l; or, not is_causal, every key). Returns [S * q_len, H, D] in q's dtype.
// wave_bytes: the most memory the partials of long rows' splits take at once (<= 0: 32 MiB).
at::Tensor rows_attention(const at::Tensor& q, const at::Tensor& cache_rows,
                          const at::Tensor& rows, const std::optional<at::Tensor>& allowed,
                          bool is_causal, int64_t q_len, int64_t num_kv_heads, int64_t path,
                          int64_t wave_bytes);

}  // namespace strata_native

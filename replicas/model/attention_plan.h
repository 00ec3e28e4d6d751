// The attention plan the native decoder stack reads (native_stack.cpp): replicas/model/
// native_stack.py's _attention_plan packs each AttentionGroup and its reads as integers and
// tensors, and unpack_groups reads them back.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace strata_native {

// One chunk of an attention group's keys (AttentionGroup.chunks, _GroupReads per chunk).
struct Chunk {
  int64_t num_seqs = 0, query_start = 0, query_end = 0;
  at::Tensor rows;  // cache rows of its keys, then values
  at::Tensor bias;  // additive mask, or undefined
  at::Tensor max_score, sum_exp, acc;  // views of the group's partials (two chunks or more)
};

// An AttentionGroup with its _GroupReads.
struct Group {
  bool rows_are_slice = true;
  int64_t row_start = 0, row_end = 0;
  at::Tensor row_index;  // the group's query rows where they are not one slice
  int64_t num_seqs = 0, q_len = 0;
  bool is_causal = false;
  std::optional<at::Tensor> allowed;
  std::vector<Chunk> chunks;
  at::Tensor m_all, l_all, o_all;  // two chunks or more
};

// Reads _attention_plan's packing (replicas/model/native_stack.py).
inline std::vector<Group> unpack_groups(const std::vector<int64_t>& ints,
                                        const std::vector<at::Tensor>& tensors) {
  size_t i = 0, t = 0;
  auto next_int = [&] { return ints.at(i++); };
  auto next_tensor = [&] { return tensors.at(t++); };
  std::vector<Group> groups(next_int());
  for (Group& g : groups) {
    g.row_start = next_int();
    g.row_end = next_int();
    g.rows_are_slice = g.row_end >= 0;
    g.num_seqs = next_int();
    g.q_len = next_int();
    g.is_causal = next_int();
    const bool has_allowed = next_int();
    g.chunks.resize(next_int());
    if (!g.rows_are_slice) g.row_index = next_tensor();
    if (has_allowed) g.allowed = next_tensor();
    for (Chunk& c : g.chunks) {
      c.num_seqs = next_int();
      c.query_start = next_int();
      c.query_end = next_int();
      const bool has_bias = next_int();
      c.rows = next_tensor();
      if (has_bias) c.bias = next_tensor();
      if (g.chunks.size() > 1) {
        c.max_score = next_tensor();
        c.sum_exp = next_tensor();
        c.acc = next_tensor();
      }
    }
    if (g.chunks.size() > 1) {
      g.m_all = next_tensor();
      g.l_all = next_tensor();
      g.o_all = next_tensor();
    }
  }
  TORCH_CHECK(i == ints.size() && t == tensors.size(), "DecoderStack: unread attention plan");
  return groups;
}

}  // namespace strata_native

// Strata's CPU attention kernel: a task's rows against their keys, split by kSplitKeys, and
// the splits combined (the arithmetic: decode_attention.cpp, which includes this once).
#pragma once

#include "attention_lanes.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace strata_native {
namespace {

// A row that sees more keys than this attends over each run of this many it sees (from its
// first), in parallel, and then combines the runs' partials (combine): so a long context's few
// sequences and kv heads (a chunk, a decode) still keep every thread busy. Where the splits
// fall depends on nothing but the keys the row sees, so a row's bits stay its own.
constexpr int64_t kSplitKeys = 512;

struct Problem {
  const float* q;        // [S * L, H, D], scaled by log2(e) / sqrt(D)
  const void* cache;
  const int64_t* rows;   // [2, S, kv heads, W]
  const bool* allowed;   // [S * L, W] or null
  float* out;            // [S * L, H, D]
  int64_t num_seqs, q_len, num_heads, num_kv_heads, head_dim, width, num_blocks;
  // Splits (see kSplitKeys): row r's split k is keys [at[k], at[k + 1]) for at = split_at +
  // r * (splits + 1); a row of fewer splits ends in empty ones. A row of more than one writes
  // each split's partial (its maximum, sum of weights and unnormalized sums of the values) to
  // the slots of its task's unit, numbered from unit0, for combine() to finish.
  const int64_t* split_at;
  int64_t splits, unit0;
  float* part_ml;  // [units, rows per block, heads per kv head, splits, 2]: maximum, sum
  float* part_o;   // [units, rows per block, heads per kv head, splits, D]
};

// Up to kHeads query heads of one kv head run together: they see the same keys, so each key
// (and value) loaded serves them all. So do up to P::kPairs / heads query rows of a sequence
// that see the same first key and no mask (a prefill or a chunk after cached keys): a tile of
// (row, head) pairs reads each key and value once for all of them, where one row at a time
// would read them once per row.
constexpr int kHeads = 4;

// Scores of NH (row, head) pairs for NG groups of kLanes keys from `panel` (transposed keys:
// [group, D, kLanes]): per key, the product of column 0, then each next column's added in one
// fused multiply-add, in column order. scores[i] is pair i's, indexed by group * kLanes.
template <typename P, int NG, int NH>
inline void score_groups(const float* const* q, const float* panel, int64_t d, int64_t group,
                         float* const* scores) {
  using V = typename P::V;
  V acc[NH][NG];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
    const V q0 = P::set1(q[h][0]);
#pragma GCC unroll 2
    for (int i = 0; i < NG; ++i) acc[h][i] = P::mul(q0, P::load(panel + i * d * kLanes));
  }
  for (int64_t c = 1; c < d; ++c) {
    V k[NG];
#pragma GCC unroll 2
    for (int i = 0; i < NG; ++i) k[i] = P::load(panel + (i * d + c) * kLanes);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const V qc = P::set1(q[h][c]);
#pragma GCC unroll 2
      for (int i = 0; i < NG; ++i) acc[h][i] = P::fma(qc, k[i], acc[h][i]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 2
    for (int i = 0; i < NG; ++i) P::store(scores[h] + (group + i) * kLanes, acc[h][i]);
  }
}

// Columns [c0, c0 + NC * kLanes) of NH pairs' weighted sums of the values of keys [first, last)
// (those `seen` hides skipped), in key order, one fused multiply-add each: weights[h][j] is
// key j's weight for pair h. The sums start at 0, or with `resume` at what out holds (the sums
// over the keys before `first`, which a tile's last rows go on from).
template <typename P, typename T, int NC, int NH>
inline void weigh_values(const float* const* weights, const T* cache, const int64_t* values,
                         const bool* seen, int64_t first, int64_t last, int64_t d, int64_t c0,
                         float* const* out, bool resume) {
  using V = typename P::V;
  V acc[NH][NC];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 4
    for (int i = 0; i < NC; ++i) {
      acc[h][i] = resume ? P::load(out[h] + c0 + i * kLanes) : P::set1(0.0f);
    }
  }
  for (int64_t j = first; j < last; ++j) {
    if (j + kValuesAhead < last) {
      fetch_ahead(cache + values[j + kValuesAhead] * d + c0, NC * kLanes * sizeof(T));
    }
    if (seen && !seen[j]) continue;
    const T* value = cache + values[j] * d + c0;
    V v[NC];
#pragma GCC unroll 4
    for (int i = 0; i < NC; ++i) v[i] = load_row<P>(value + i * kLanes);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const V weight = P::set1(weights[h][j]);
#pragma GCC unroll 4
      for (int i = 0; i < NC; ++i) acc[h][i] = P::fma(weight, v[i], acc[h][i]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 4
    for (int i = 0; i < NC; ++i) P::store(out[h] + c0 + i * kLanes, acc[h][i]);
  }
}

// The keys one query row sees: [first, last) of its sequence's, less those `seen` hides;
// its scores fill whole groups of kLanes keys, groups [g0, g1) from the panel's first.
struct RowKeys {
  int64_t first, last, origin, g0, g1;
  const bool* seen;
};

// A row's weights from its scores (indexed from the panel's first key, kLanes per group):
// 2^(s - max), exactly 0 for a key it does not see.
template <typename P>
inline float softmax_weights(float* scores, const RowKeys& k) {
  using V = typename P::V;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float* at = scores - k.origin;  // at[j]: key j's
  const int64_t from = k.origin + k.g0 * kLanes, to = k.origin + k.g1 * kLanes;
  auto hide = [&](float value) {
    for (int64_t j = from; j < k.first; ++j) at[j] = value;
    for (int64_t j = k.last; j < to; ++j) at[j] = value;
    if (k.seen) {
      for (int64_t j = k.first; j < k.last; ++j) {
        if (!k.seen[j]) at[j] = value;
      }
    }
  };
  hide(minus_inf);
  V maxima = P::set1(minus_inf);
  for (int64_t g = k.g0; g < k.g1; ++g) maxima = P::max(maxima, P::load(scores + g * kLanes));
  float lanes[kLanes];
  P::store(lanes, maxima);
  float max_score = minus_inf;
  for (const float x : lanes) max_score = std::max(max_score, x);
  const V m = P::set1(max_score);
  for (int64_t g = k.g0; g < k.g1; ++g) {
    P::store(scores + g * kLanes, exp2_nonpositive<P>(P::sub(P::load(scores + g * kLanes), m)));
  }
  hide(0.0f);
  return max_score;
}

// Columns [c0, c0 + NC * kLanes) of NP pairs' weighted sums of the values: over the keys
// [first, common) all of them see at once, then each pair's on over the rest of its own.
template <typename P, typename T, int NC, int NP>
inline void weigh_tile(const float* const* weights, const T* cache, const int64_t* values,
                       const RowKeys* const* k, int64_t first, int64_t common, int64_t d,
                       int64_t c0, float* const* out) {
  const bool* seen = k[0]->seen;
  weigh_values<P, T, NC, NP>(weights, cache, values, seen, first, common, d, c0, out, false);
  for (int p = 0; p < NP; ++p) {
    if (k[p]->last > common) {
      weigh_values<P, T, NC, 1>(&weights[p], cache, values, seen, common, k[p]->last, d, c0,
                                &out[p], true);
    }
  }
}

// NP (row, head) pairs of rows that see the same first key and, when a mask hides keys, of one
// row: q[p] its scaled query, k[p] the keys its row sees, scores[p] room for its scores, out[p]
// its output row. Every step of a pair is the one it takes alone: its scores cover groups
// [g0, g1) of its own keys (the tile scores the groups of all, the others unused), its weights
// and their sum run over its own keys in key order, and its values' sum goes over the keys all
// the tile's rows see, then on (resumed) over the rest of its own. A pair with partial[p] (one
// split of a row's keys) leaves its sums undivided there, with its maximum and weights' sum.
template <typename P, typename T, int NP>
inline void attend_pairs(const float* const* q, const float* panel, const T* cache,
                         const int64_t* values, const RowKeys* const* k, int64_t d,
                         float* const* scores, float* const* out, float* const* partial) {
  const int64_t first = k[0]->first, g0 = k[0]->g0;
  int64_t g1 = k[0]->g1, common = k[0]->last;
  for (int p = 1; p < NP; ++p) {
    g1 = std::max(g1, k[p]->g1);
    common = std::min(common, k[p]->last);
  }
  constexpr int64_t groups = P::kScoreGroups;
  int64_t g = g0;
  for (; g + groups <= g1; g += groups) {
    score_groups<P, groups, NP>(q, panel + g * d * kLanes, d, g, scores);
  }
  for (; g < g1; ++g) score_groups<P, 1, NP>(q, panel + g * d * kLanes, d, g, scores);
  const float* weights[NP];
  float maxima[NP];
  for (int p = 0; p < NP; ++p) {
    maxima[p] = softmax_weights<P>(scores[p], *k[p]);
    weights[p] = scores[p] - k[p]->origin;
  }
  // Each pair's sum of its weights, one key at a time in key order (a hidden key's 0 changes
  // nothing): the same bits however the keys are laid out or padded.
  float sums[NP];
  for (int p = 0; p < NP; ++p) sums[p] = 0.0f;
  for (int64_t j = first; j < common; ++j) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) sums[p] = sums[p] + weights[p][j];
  }
  for (int p = 0; p < NP; ++p) {
    for (int64_t j = common; j < k[p]->last; ++j) sums[p] = sums[p] + weights[p][j];
  }
  constexpr int64_t chunks = P::kValueChunks;
  int64_t c0 = 0;
  for (; c0 + chunks * kLanes <= d; c0 += chunks * kLanes) {
    weigh_tile<P, T, chunks, NP>(weights, cache, values, k, first, common, d, c0, out);
  }
  for (; c0 < d; c0 += kLanes) {
    weigh_tile<P, T, 1, NP>(weights, cache, values, k, first, common, d, c0, out);
  }
  for (int p = 0; p < NP; ++p) {
    if (partial[p]) {
      partial[p][0] = maxima[p];
      partial[p][1] = sums[p];
      continue;
    }
    for (int64_t i = 0; i < d; ++i) out[p][i] = out[p][i] / sums[p];
  }
}

// attend_pairs for np pairs, 1 <= np <= NP_MAX.
template <typename P, typename T, int NP_MAX, int NP = 1>
inline void attend_tile(int np, const float* const* q, const float* panel, const T* cache,
                        const int64_t* values, const RowKeys* const* k, int64_t d,
                        float* const* scores, float* const* out, float* const* partial) {
  if constexpr (NP < NP_MAX) {
    if (np > NP) {
      attend_tile<P, T, NP_MAX, NP + 1>(np, q, panel, cache, values, k, d, scores, out, partial);
      return;
    }
  }
  attend_pairs<P, T, NP>(q, panel, cache, values, k, d, scores, out, partial);
}

// A unit of a problem: one sequence, kv head and block of query rows [row0, row1).
struct Unit {
  int64_t seq, kv_head, row0, row1;
};

inline Unit unit_of(const Problem& pr, int64_t unit) {
  // Blocks interleaved from both ends, so that threads share a causal prefill evenly.
  const int64_t b = unit % pr.num_blocks, rest = unit / pr.num_blocks;
  const int64_t block = b % 2 == 0 ? b / 2 : pr.num_blocks - 1 - b / 2;
  const int64_t rows_per_block = (pr.q_len + pr.num_blocks - 1) / pr.num_blocks;
  const int64_t s = rest / pr.num_kv_heads, row0 = s * pr.q_len + block * rows_per_block;
  return {s, rest % pr.num_kv_heads, row0,
          std::min(s * pr.q_len + pr.q_len, row0 + rows_per_block)};
}

inline const int64_t* split_of(const Problem& pr, int64_t row, int64_t k) {
  return pr.split_at + row * (pr.splits + 1) + k;  // [0]: its first key, [1]: one past its last
}

// The keys [lo, hi) that a unit's rows see in split k; false when none does.
inline bool split_span(const Problem& pr, const Unit& u, int64_t k, int64_t& lo, int64_t& hi) {
  lo = pr.width, hi = 0;
  for (int64_t r = u.row0; r < u.row1; ++r) {
    const int64_t* at = split_of(pr, r, k);
    if (at[0] < at[1]) lo = std::min(lo, at[0]), hi = std::max(hi, at[1]);
  }
  return lo < hi;
}

// The keys [lo, hi) transposed into `panel` ([key group, D, kLanes], groups from lo's), with
// the next group's rows asked for while one is transposed.
template <typename P, typename T>
inline void transpose_keys(const T* cache, const int64_t* keys, int64_t lo, int64_t hi,
                           int64_t d, std::vector<float>& panel) {
  using V = typename P::V;
  const int64_t origin = lo / kLanes * kLanes;
  const int64_t num_groups = (hi - origin + kLanes - 1) / kLanes;
  panel.resize(num_groups * d * kLanes);
  for (int64_t group = 0; group < num_groups; ++group) {
    const int64_t j0 = origin + group * kLanes;
    for (int64_t j = std::max(j0 + kLanes, lo); j < std::min(j0 + 2 * kLanes, hi); ++j) {
      fetch_ahead(cache + keys[j] * d, d * static_cast<int64_t>(sizeof(T)));  // the next group's
    }
    for (int64_t c = 0; c < d; c += kLanes) {  // 16 keys by 16 columns at a time
      float tile[kLanes * kLanes];
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t j = j0 + i;
        const V row = j >= lo && j < hi ? load_row<P>(cache + keys[j] * d + c) : P::set1(0.0f);
        P::store(tile + i * kLanes, row);
      }
      P::transpose16(tile, &panel[(group * d + c) * kLanes]);
    }
  }
}

// Tasks [begin, end) of a problem, a task being split k of one unit's rows (every row's own
// keys when no row is split). The keys the rows see in the split are transposed into a panel
// of kLanes keys by D columns, so that a query row's scores come kLanes keys at a time, one
// multiply-add per column; then, per tile of rows (attend_pairs), their softmax over kLanes
// keys at a time and the weighted sums of the values, kLanes columns at a time. Every step a
// row takes depends on nothing but the row and the keys it sees.
template <typename P, typename T>
inline void attend(const Problem& pr, int64_t begin, int64_t end_task) {
  const int64_t d = pr.head_dim, w = pr.width;
  const int64_t heads = pr.num_heads / pr.num_kv_heads;
  const int64_t rows_per_block = (pr.q_len + pr.num_blocks - 1) / pr.num_blocks;
  const T* cache = static_cast<const T*>(pr.cache);
  std::vector<float> panel;   // [key group, D, kLanes]: the split's keys, transposed
  constexpr int kMaxPairs = std::max(P::kPairs, kHeads);
  std::vector<float> scores;  // [kMaxPairs, groups * kLanes]: a tile's scores, then weights
  for (int64_t task = begin; task < end_task; ++task) {
    const int64_t k = task % pr.splits, unit = pr.unit0 + task / pr.splits;
    const Unit u = unit_of(pr, unit);
    const int64_t* keys = pr.rows + (u.seq * pr.num_kv_heads + u.kv_head) * w;
    const int64_t* values = keys + pr.num_seqs * pr.num_kv_heads * w;
    int64_t lo, hi;
    if (!split_span(pr, u, k, lo, hi)) continue;  // every row's keys end in an earlier split
    transpose_keys<P, T>(cache, keys, lo, hi, d, panel);
    const int64_t origin = lo / kLanes * kLanes, stride = panel.size() / d;
    scores.resize(kMaxPairs * stride);
    for (int64_t h0 = u.kv_head * heads; h0 < (u.kv_head + 1) * heads; h0 += kHeads) {
      const int nh = static_cast<int>(std::min<int64_t>(kHeads, (u.kv_head + 1) * heads - h0));
      const int64_t tile_rows = pr.allowed ? 1 : std::max(1, P::kPairs / nh);
      for (int64_t r0 = u.row0; r0 < u.row1;) {
        if (split_of(pr, r0, k)[0] >= split_of(pr, r0, k)[1]) {
          ++r0;
          continue;
        }
        RowKeys row_keys[kMaxPairs];
        const RowKeys* pair_keys[kMaxPairs];
        const float* q[kMaxPairs];
        float* score_rows[kMaxPairs];
        float* out[kMaxPairs];
        float* partial[kMaxPairs];
        int np = 0;
        int64_t r = r0;
        for (; r < u.row1 && r < r0 + tile_rows && split_of(pr, r, k)[0] == split_of(pr, r0, k)[0];
             ++r) {
          const int64_t* at = split_of(pr, r, k);
          RowKeys& keys_of_row = row_keys[r - r0];
          keys_of_row = {at[0], at[1], origin, (at[0] - origin) / kLanes,
                         (at[1] - origin + kLanes - 1) / kLanes,
                         pr.allowed ? pr.allowed + r * w : nullptr};
          const bool split = pr.splits > 1 && split_of(pr, r, 1)[0] < split_of(pr, r, 1)[1];
          for (int h = 0; h < nh; ++h, ++np) {
            const int64_t slot =
                (((unit - pr.unit0) * rows_per_block + r - u.row0) * heads + h0 + h -
                 u.kv_head * heads) * pr.splits + k;
            pair_keys[np] = &keys_of_row;
            q[np] = pr.q + (r * pr.num_heads + h0 + h) * d;
            score_rows[np] = scores.data() + np * stride;
            out[np] = split ? pr.part_o + slot * d : pr.out + (r * pr.num_heads + h0 + h) * d;
            partial[np] = split ? pr.part_ml + 2 * slot : nullptr;
          }
        }
        attend_tile<P, T, kMaxPairs>(np, q, panel.data(), cache, values, pair_keys, d,
                                     score_rows, out, partial);
        r0 = r;
      }
    }
  }
}

// Units [begin, end) of a problem's wave (numbered from unit0): each split row's output from
// its splits' partials, in split order: M the largest maximum, c_k = 2^(m_k - M), and
// out = (sum_k c_k o_k) / (sum_k c_k l_k), each sum one term at a time, a column's in one
// fused multiply-add per split.
template <typename P>
inline void combine(const Problem& pr, int64_t begin, int64_t end) {
  using V = typename P::V;
  const int64_t d = pr.head_dim, heads = pr.num_heads / pr.num_kv_heads;
  const int64_t rows_per_block = (pr.q_len + pr.num_blocks - 1) / pr.num_blocks;
  std::vector<float> scale(pr.splits);
  for (int64_t unit = pr.unit0 + begin; unit < pr.unit0 + end; ++unit) {
    const Unit u = unit_of(pr, unit);
    for (int64_t r = u.row0; r < u.row1; ++r) {
      int64_t n = 0;
      while (n < pr.splits && split_of(pr, r, n)[0] < split_of(pr, r, n)[1]) ++n;
      if (n < 2) continue;  // attended whole, out written
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t slot0 =
            (((unit - pr.unit0) * rows_per_block + r - u.row0) * heads + h) * pr.splits;
        const float* ml = pr.part_ml + 2 * slot0;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < n; ++k) top = std::max(top, ml[2 * k]);
        float sum = 0.0f;
        for (int64_t k = 0; k < n; ++k) {
          float lanes[kLanes];
          P::store(lanes, exp2_nonpositive<P>(P::set1(ml[2 * k] - top)));
          scale[k] = lanes[0];
          sum = sum + scale[k] * ml[2 * k + 1];
        }
        float* out = pr.out + (r * pr.num_heads + u.kv_head * heads + h) * d;
        for (int64_t c = 0; c < d; c += kLanes) {
          V acc = P::set1(0.0f);
          for (int64_t k = 0; k < n; ++k) {
            acc = P::fma(P::set1(scale[k]), P::load(pr.part_o + (slot0 + k) * d + c), acc);
          }
          P::store(out + c, acc);
        }
        for (int64_t i = 0; i < d; ++i) out[i] = out[i] / sum;
      }
    }
  }
}

}  // namespace
}  // namespace strata_native

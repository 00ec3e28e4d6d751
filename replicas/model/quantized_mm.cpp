// Strata's quantized products: y = x W^T for a weight W kept as integer codes with float16 scales
// per output row and group of 32 input columns, against activations quantized on the fly to int8
// per group of 32, the schemes llama.cpp runs GGUF Q4_1 and Q8_0 with:
//
//   int4_mm: w = d * q + m, q in [0, 15] (or 31)     int8_mm: w = d * q, q in [-127, 127]
//
// The activations are quantized in one or two passes, the layer's choice (x ~ dx0 * qx0, or
// dx0 * qx0 + dx1 * qx1, per row and group, qx in [-127, 127]; QuantizedRows). A group's
// integer dot product sum(q * qx) is exact in int32 whatever the instructions (AVX-512 VNNI,
// AVX2, or plain C++), and the float steps that follow are the same for every path, row and
// batch:
//
//   acc += float(sum(q * qx0)) * (d * dx0);  acc += float(sum(q * qx1)) * (d * dx1) (two passes);
//   acc += m * sx  (int4 only; sx the float sum of the group's activations)
//
// group after group, in order. So a row's result is bitwise the same on every CPU path and
// whatever other rows share the call (the engine's outputs do not depend on batching, chunking or
// prefix caching). The library is compiled with -ffp-contract=off and the vector paths use
// separate multiplies and adds, as the scalar one does.
//
// Layouts (replicas/model/quant.py), both in tiles of 16 output rows, so that one 64-byte load
// holds 16 rows' codes for a few columns and one VNNI multiply-add (16 lanes of 4 bytes) takes them:
// - int4: one 64-byte chunk per 8 input columns: byte 4 c + r holds row c's column 8 o + r in its
//   low nibble and column 8 o + 4 + r in its high nibble ([N / 16, K / 8, 64] uint8); d and m per
//   tile and group as [N / 16, K / 32, 2, 16] float16, or, for a GGUF Q4_K weight, as its own
//   6-bit codes under a float16 pair per 8 groups ([N / 16, K / 256, 320] uint8: D[16] and
//   -Dmin[16] float16, then per group sc[16] and mn[16]; d = D sc and m = -Dmin mn, both exact
//   in float32): 4.625 bits a weight in all, against 5. 5-bit codes (q in [0, 31], a GGUF Q5_0,
//   Q5_1 or Q5_K weight's) add a fifth 64-byte chunk per group of 32 columns with their high
//   bits (byte 4 c + r, bit 2 o for column 8 o + r, bit 2 o + 1 for column 8 o + 4 + r):
//   [N / 16, K / 32 * 5, 64]; int4_mm tells them apart by the codes' shape. A GGUF IQ4_NL or
//   IQ4_XS weight's 4-bit indices into its 16 levels take int4's layout as int8 ([N / 16, K / 8,
//   64]: int4_mm tells it by the codes' type), each index standing for its level + 128 and
//   m = -128 d, so that q = level + 128 in [1, 241] and w = d * level.
//   int4_mm also takes a GGUF Q2_K weight as stored, 2.625 bits a weight (quantized_mm2.cpp).
// - int8: one 64-byte chunk per 4 input columns: byte 4 c + r is row c's column 4 o + r
//   ([N / 16, K / 4, 64] int8); d per tile and group as [N / 16, K / 32, 16] float16. int8_mm
//   also takes a GGUF Q6_K weight as stored, 6.5625 bits a weight (quantized_mm6.cpp).

#include "quantized_mm.h"
#include "native_isa.h"
#include "quantized_rows.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace strata_native {
namespace {

int64_t cpu_path();

// AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25), and Linux's leave to use their
// registers (ARCH_REQ_XCOMP_PERM for XTILEDATA, granted to the whole process).
bool amx_supported() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) {
    return false;
  }
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

}  // namespace

bool amx_ready() {
  static const bool ready = amx_supported();
  return ready;
}

namespace {

// The best path this CPU has, at most STRATA_NATIVE_ISA's (native_isa.h).
int64_t best_path() { return std::min(isa_cap(), cpu_path()); }

int64_t cpu_path() {
  static const int64_t path = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return amx_ready() ? kPathAmx : kPathAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      return kPathAvx2;
    }
    return kPathScalar;
  }();
  return path;
}


// Shared by int4_mm and int8_mm: what a scheme's layout has per tile and group, to check the
// arguments and step through them.
struct Scheme {
  const char* name;
  at::ScalarType code_type;
  int64_t chunks_per_group;   // 64-byte chunks of codes per tile and group of 32 columns
  int64_t scales_per_group;   // 16-bit slots of scales per tile and group
  const PathKernels& kernels;
  at::ScalarType scale_type = at::kHalf;  // kByte: K-quant scales, a block per 8 groups
  AmxTileKernel amx = nullptr;            // the AMX kernel, if the layout has one
};

// One weight of a product: its layout, codes and scales, and where its rows go in the output.
struct Part {
  const Scheme* scheme;
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t tiles, first_tile;  // its tiles of 16 rows, and where they start among all the parts'
};

// Checks a weight of `scheme` against K = k columns and makes it a Part.
Part check_part(const Scheme& scheme, int64_t k, const at::Tensor& codes,
                const at::Tensor& scales, int64_t out_features) {
  const char* name = scheme.name;
  TORCH_CHECK(codes.scalar_type() == scheme.code_type && codes.dim() == 3 &&
                  codes.size(2) == 64 && codes.is_contiguous(),
              name, ": codes must be contiguous ", scheme.code_type, " [N / 16, K / 32 * ",
              scheme.chunks_per_group, ", 64]");
  const int64_t tiles = codes.size(0), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && codes.size(1) == groups * scheme.chunks_per_group, name,
              ": x has ", k, " columns, the weight ", codes.size(1) / scheme.chunks_per_group * kGroup);
  const bool super = scheme.scale_type == at::kByte;
  TORCH_CHECK(!super || groups % kSuperGroups == 0, name, ": K-quant scales need K a multiple of ",
              kSuperGroups * kGroup, ", got ", k);
  TORCH_CHECK(scales.scalar_type() == scheme.scale_type && scales.is_contiguous() &&
                  scales.nbytes() == size_t(tiles * groups * scheme.scales_per_group * 2),
              name, ": scales must be contiguous ", scheme.scale_type, " with ",
              scheme.scales_per_group * 2, " bytes per tile and group");
  TORCH_CHECK(out_features <= tiles * kTile, name, ": out_features beyond the packed rows");
  return {&scheme, static_cast<const uint8_t*>(codes.const_data_ptr()),
          static_cast<const uint16_t*>(scales.const_data_ptr()), tiles, 0};
}

// x times every part's weight, their rows one after the other: float32 [M, 16 x their tiles].
// The activations are quantized once for all of them, and one parallel loop takes every tile.
at::Tensor run_parts(const char* name, std::vector<Part>& parts, const at::Tensor& x,
                     int64_t passes, int64_t path) {
  TORCH_CHECK(passes == 1 || passes == 2, name, ": passes must be 1 or 2, got ", passes);
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), name, ": x must be a 2-D CPU tensor");
  int64_t tiles = 0;
  for (Part& part : parts) {
    part.first_tile = tiles;
    tiles += part.tiles;
  }
  const at::Tensor input = x.contiguous();
  QuantizedRows q;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "quantized_mm",
                                  [&] { q = quantize_rows<scalar_t>(input, passes); });
  const int64_t rows = q.rows, k = input.size(1), groups = k / kGroup;
  at::Tensor out = at::empty({rows, tiles * kTile}, x.options().dtype(at::kFloat));
  const int64_t chosen = std::min(path < 0 ? best_path() : path, best_path());
  // AMX takes the blocks of 16 rows where a part's layout has an AMX kernel, the vector kernel
  // the rest
  const int64_t amx_rows = chosen == kPathAmx ? rows / kTile * kTile : 0;
  bool any_amx = false;
  for (const Part& part : parts) any_amx = any_amx || part.scheme->amx != nullptr;
  if (amx_rows > 0 && any_amx) tile_rows(q, amx_rows);
  float* out_data = out.mutable_data_ptr<float>();
  const int64_t width = tiles * kTile;
  // Tasks of at least 65,536 multiply-adds (4,096 / (K x rows) tiles): a decode row's product
  // is split between the threads too (SmolLM2 at 2 threads: its decode step 5.3-5.9 ms against
  // 6.0-6.2 with the products of a decode row kept on one thread), while the smallest products
  // stay whole.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 12) / (k * std::max<int64_t>(rows, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    size_t p = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= parts[p].first_tile + parts[p].tiles) ++p;
      const Part& part = parts[p];
      const Scheme& scheme = *part.scheme;
      const int64_t local = t - part.first_tile;
      const uint8_t* codes = part.codes + local * groups * scheme.chunks_per_group * 64;
      const uint16_t* scales = part.scales + local * groups * scheme.scales_per_group;
      const int64_t done = scheme.amx != nullptr ? amx_rows : 0;
      if (done > 0) scheme.amx(codes, scales, q, done, out_data + t * kTile, width);
      const TileKernel kernel = scheme.kernels[std::min(chosen, kPathAvx512)];
      for (int64_t r = done; r < rows; r += kRowBlock) {
        kernel(codes, scales, q, r, std::min(kRowBlock, rows - r), out_data + r * width + t * kTile,
               width);
      }
    }
  });
  return out;
}

at::Tensor quantized_mm(const Scheme& scheme, const at::Tensor& x, const at::Tensor& codes,
                        const at::Tensor& scales, int64_t out_features, int64_t passes,
                        int64_t path) {
  TORCH_CHECK(x.dim() == 2, scheme.name, ": x must be a 2-D CPU tensor");
  std::vector<Part> parts{check_part(scheme, x.size(1), codes, scales, out_features)};
  at::Tensor out = run_parts(scheme.name, parts, x, passes, path);
  return out.size(1) == out_features ? out : out.narrow(1, 0, out_features);
}

// The layout of an int4_mm weight, told by its codes' type and shape and its scales' type.
const Scheme& int4_scheme(int64_t k, const at::Tensor& codes, const at::Tensor& scales) {
  constexpr int64_t kHalves = 2 * kTile, kSuperSlots = kSuperHalfs / kSuperGroups;
  static const Scheme schemes[2][2] = {
      {{"int4_mm", at::kByte, 4, kHalves, kInt4Kernels[0][0], at::kHalf, kInt4Amx[0][0]},
       {"int4_mm", at::kByte, 5, kHalves, kInt4Kernels[0][1], at::kHalf, kInt4Amx[0][1]}},
      {{"int4_mm", at::kByte, 4, kSuperSlots, kInt4Kernels[1][0], at::kByte, kInt4Amx[1][0]},
       {"int4_mm", at::kByte, 5, kSuperSlots, kInt4Kernels[1][1], at::kByte, kInt4Amx[1][1]}}};
  // int8 codes: an IQ4 weight's indices into its 16 levels (quantized_mm4.cpp, kBits 8)
  static const Scheme levels{"int4_mm", at::kChar, 4, kHalves, kLevelsKernels, at::kHalf,
                             kLevelsAmx};
  if (codes.scalar_type() == at::kChar) return levels;
  const bool super = scales.scalar_type() == at::kByte;  // K-quant scales as stored
  // two chunks per group of 32 columns: a GGUF Q2_K weight as stored (quantized_mm2.cpp)
  static const Scheme two_bit{"int4_mm", at::kByte, 2, kSuperSlots, kTwoBitKernels, at::kByte,
                               kTwoBitAmx};
  if (super && codes.dim() == 3 && codes.size(1) * kGroup == k * 2) return two_bit;
  // 5-bit codes (a GGUF Q5 weight's): a fifth chunk per group of 32 columns
  const bool five = codes.dim() == 3 && codes.size(1) * kGroup == k * 5;
  return schemes[super][five];
}

// The layout of an int8_mm weight, told by its scales' type.
const Scheme& int8_scheme(const at::Tensor& scales) {
  static const Scheme scheme{"int8_mm", at::kChar, 8, kTile, kInt8Kernels, at::kHalf, kInt8Amx};
  // uint8 scales: a GGUF Q6_K weight's 6-bit codes and scales as stored (quantized_mm6.cpp)
  static const Scheme six_bit{"int8_mm", at::kByte, 6, 18, kSixBitKernels, at::kByte};
  return scales.scalar_type() == at::kByte ? six_bit : scheme;
}

}  // namespace

int64_t quantized_mm_path(int64_t requested) {
  return std::min(requested < 0 ? best_path() : requested, best_path());
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t out_features, int64_t passes, int64_t path) {
  RECORD_FUNCTION("strata_native::int4_mm", std::vector<c10::IValue>());  // for profiles
  TORCH_CHECK(x.dim() == 2, "int4_mm: x must be a 2-D CPU tensor");
  return quantized_mm(int4_scheme(x.size(1), codes, scales), x, codes, scales, out_features,
                      passes, path);
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t out_features, int64_t passes, int64_t path) {
  RECORD_FUNCTION("strata_native::int8_mm", std::vector<c10::IValue>());  // for profiles
  return quantized_mm(int8_scheme(scales), x, codes, scales, out_features, passes, path);
}

at::Tensor mixed_mm(const at::Tensor& x, const std::vector<at::Tensor>& codes,
                    const std::vector<at::Tensor>& scales, const std::vector<int64_t>& int4,
                    const std::vector<int64_t>& out_features, int64_t passes, int64_t path) {
  RECORD_FUNCTION("strata_native::mixed_mm", std::vector<c10::IValue>());  // for profiles
  const size_t n = codes.size();
  TORCH_CHECK(n > 0 && scales.size() == n && int4.size() == n && out_features.size() == n,
              "mixed_mm: codes, scales, int4 and out_features must name the same weights");
  TORCH_CHECK(x.dim() == 2, "mixed_mm: x must be a 2-D CPU tensor");
  const int64_t k = x.size(1);
  std::vector<Part> parts;
  for (size_t i = 0; i < n; ++i) {
    const Scheme& scheme = int4[i] ? int4_scheme(k, codes[i], scales[i]) : int8_scheme(scales[i]);
    parts.push_back(check_part(scheme, k, codes[i], scales[i], out_features[i]));
    TORCH_CHECK(i + 1 == n || out_features[i] == parts.back().tiles * kTile,
                "mixed_mm: every weight but the last must have a multiple of 16 rows");
  }
  at::Tensor out = run_parts("mixed_mm", parts, x, passes, path);
  const int64_t total = parts.back().first_tile * kTile + out_features.back();
  return out.size(1) == total ? out : out.narrow(1, 0, total);
}

}  // namespace strata_native

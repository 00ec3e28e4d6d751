// How far up the instruction sets Strata's native kernels may go in this process.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace strata_native {

// The instruction paths of the native kernels (quantized_mm, decode_attention), each also
// allowing the ones below it: for the products, AVX-512 means its VNNI instructions too.
constexpr int64_t kPathScalar = 0;
constexpr int64_t kPathAvx2 = 1;
constexpr int64_t kPathAvx512 = 2;
// The products only: AVX-512 VNNI with AMX tiles for the blocks of 16 activation rows.
constexpr int64_t kPathAmx = 3;

// STRATA_NATIVE_ISA caps the instruction path of every native kernel (int4_mm, decode_attention):
// "avx512" (no AMX), "avx2" or "scalar", to measure a lesser CPU's paths on this one (with
// torch's own dispatch capped by ATEN_CPU_CAPABILITY); unset or "amx", the best this CPU has.
// replicas/model/native_stack.py refuses any other value before the library loads.
inline int64_t isa_cap() {
  static const int64_t cap = [] {
    const char* value = std::getenv("STRATA_NATIVE_ISA");
    if (value != nullptr && std::strcmp(value, "scalar") == 0) return kPathScalar;
    if (value != nullptr && std::strcmp(value, "avx2") == 0) return kPathAvx2;
    if (value != nullptr && std::strcmp(value, "avx512") == 0) return kPathAvx512;
    return kPathAmx;
  }();
  return cap;
}

}  // namespace strata_native

// How far up the instruction sets Strata's native kernels may go in this process.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace strata_native {

// STRATA_NATIVE_ISA caps the instruction path of every native kernel (int4_mm, decode_attention):
// "avx2" or "scalar", to measure a lesser CPU's paths on this one (with torch's own dispatch
// capped by ATEN_CPU_CAPABILITY); unset or "avx512", the best this CPU has. The kernels number
// their paths alike: 0 plain C++, 1 AVX2, 2 AVX-512. replicas/model/native_stack.py refuses any
// other value before the library loads.
inline int64_t isa_cap() {
  static const int64_t cap = [] {
    const char* value = std::getenv("STRATA_NATIVE_ISA");
    if (value != nullptr && std::strcmp(value, "scalar") == 0) return int64_t{0};
    if (value != nullptr && std::strcmp(value, "avx2") == 0) return int64_t{1};
    return int64_t{2};
  }();
  return cap;
}

}  // namespace strata_native

// The panel layout of vitkit's fp32 products (fp32_gemm.h, fp32_gemm_avx2.h, gemm.cpp): a weight W (N, K), in
// nn.Linear's row-major layout, as N / nr panels of nr output columns, k-major: panel p, step k holds
// W[nr p .. nr p + nr - 1, k], the nr values a tile's step multiplies by one row's value.
#pragma once

#include <cstdint>

namespace vitkit {

// Panels [p0, p1) of w (N, K), N a multiple of nr, into packed (N / nr, K, nr).
inline void pack_panels(const float* w, int64_t K, int64_t nr, int64_t p0, int64_t p1, float* packed) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < nr; ++j) packed[(p * K + k) * nr + j] = w[(p * nr + j) * K + k];
}

}  // namespace vitkit

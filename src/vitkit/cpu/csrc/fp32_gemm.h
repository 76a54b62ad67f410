// vitkit's fp32 product for AVX-512 CPUs, for the fp32 block operator (fp32_block.cpp): y = x W^T + b, with the
// residual add or GELU applied in the tile.
//
// The weight is packed once into panels of 64 output columns, k-major ([K][64] floats each). A tile is 6 rows x
// 64 columns in 24 zmm sums over the whole inner dimension: each step four loads of the panel, a broadcast of
// each row's value and 24 FMAs. The rows are walked in blocks of about 96 (fewer for a wide inner dimension:
// a block's rows, at most ~288 KiB, stay in L2) while every panel streams past them. On 2 cores of an AMD EPYC
// (Zen 4), ViT-S/16's and ViT-B/16's layers at 197 and 3152 rows, the weights read from memory as in a model's
// call: 91-95 % of the FMA peak, oneDNN's products' share too; what the block operator saves is elsewhere
// (fp32_block.cpp).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "avx512_math.h"
#include "block_region.h"
#include "panels.h"

#define VITKIT_F32 __attribute__((target("avx512f")))

namespace vitkit_f32 {

constexpr int64_t NR = 64;  // columns of a panel: four zmm
constexpr int64_t MR = 6;   // rows of a tile: 24 sums + 4 weights + 1 broadcast of 32 zmm

// w (N, K) row-major, N a multiple of NR -> panels (N / NR, K, NR) (panels.h).
inline void pack_weight(const float* w, int64_t N, int64_t K, float* packed) {
  vitkit::pack_panels(w, K, NR, 0, N / NR, packed);
}

using vitkit_avx512::Epilogue;

// One R x NR tile: c[m][n] = bias[n] + sum_k a[m][k] w[n][k], then the epilogue; res may be c itself (each
// value is read before its own store). The panel b is 64-byte aligned.
template <int R, Epilogue E>
VITKIT_F32 inline void tile(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t K,
                            const float* bias, float* c, int64_t ldc, const float* res, int64_t ldr) {
  __m512 acc[MR][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_load_ps(b + k * NR), w1 = _mm512_load_ps(b + k * NR + 16);
    const __m512 w2 = _mm512_load_ps(b + k * NR + 32), w3 = _mm512_load_ps(b + k * NR + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      acc[r][0] = _mm512_fmadd_ps(x, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(x, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      __m512 y = acc[r][j];
      if constexpr (E == Epilogue::kResidual) y = _mm512_add_ps(y, _mm512_loadu_ps(res + r * ldr + 16 * j));
      if constexpr (E == Epilogue::kGelu || E == Epilogue::kGeluTanh)
        y = vitkit_avx512::gelu512<E == Epilogue::kGeluTanh>(y);
      _mm512_storeu_ps(c + r * ldc + 16 * j, y);
    }
}

// c (M, N) = x (M, K) W^T + b with the epilogue, on the calling thread; x, c and res with row strides lda, ldc,
// ldr.
template <Epilogue E>
VITKIT_F32 void gemm(const float* x, int64_t lda, int64_t M, int64_t K, const float* packed, const float* bias,
                     int64_t N, float* c, int64_t ldc, const float* res = nullptr, int64_t ldr = 0) {
  const int64_t target = std::clamp<int64_t>(288 * 1024 / (4 * K) / MR * MR, 4 * MR, 16 * MR);
  vitkit::row_blocks(0, M, MR, target, [&](int64_t m0, int64_t m1) {
    for (int64_t n = 0; n < N; n += NR) {
      const float* panel = packed + n * K;
      const float* bn = bias ? bias + n : nullptr;
      for (int64_t m = m0; m < m1; m += MR) {
        const float* rm = res ? res + m * ldr + n : nullptr;
        switch (std::min(MR, m1 - m)) {
          case 6: tile<6, E>(x + m * lda, lda, panel, K, bn, c + m * ldc + n, ldc, rm, ldr); break;
          case 5: tile<5, E>(x + m * lda, lda, panel, K, bn, c + m * ldc + n, ldc, rm, ldr); break;
          case 4: tile<4, E>(x + m * lda, lda, panel, K, bn, c + m * ldc + n, ldc, rm, ldr); break;
          case 3: tile<3, E>(x + m * lda, lda, panel, K, bn, c + m * ldc + n, ldc, rm, ldr); break;
          case 2: tile<2, E>(x + m * lda, lda, panel, K, bn, c + m * ldc + n, ldc, rm, ldr); break;
          default: tile<1, E>(x + m * lda, lda, panel, K, bn, c + m * ldc + n, ldc, rm, ldr); break;
        }
      }
    }
  });
}

}  // namespace vitkit_f32

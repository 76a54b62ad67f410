// vitkit's bf16 product for CPUs with AVX512-BF16, for the bf16 block operator (bf16_block.cpp): y = x W^T + b
// on bf16 rows and weights, summed in fp32, with the residual add or GELU applied in the tile and the result
// rounded to bf16 (to nearest even) as it is stored.
//
// vdpbf16ps multiplies pairs: lane l of the sum gains a[2l] b[2l] + a[2l + 1] b[2l + 1]. So the weight is packed
// once into panels of 64 output columns, each [K/2][64][2] bf16 (a pair of inner steps of 64 columns: four zmm),
// and a row's pair of inputs is broadcast against them. A tile is 6 rows x 64 columns in 24 zmm sums over the
// whole inner dimension: each pair of steps four loads of the panel, a broadcast per row and 24 vdpbf16ps, the
// layout of fp32_gemm.h's and int8_gemm.h's tiles. The rows are walked in blocks that stay in L2 while every
// panel streams past them.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "avx512_math.h"
#include "block_region.h"

#define VITKIT_BF16_GEMM __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace vitkit_bf16 {

constexpr int64_t NR = 64;  // columns of a panel: four zmm
constexpr int64_t MR = 6;   // rows of a tile: 24 sums + 4 weights + 1 broadcast of 32 zmm

// w (N, K) bf16 row-major, N a multiple of NR, K even -> panels (N / NR, K / 2, NR, 2): panel p, pair e holds
// W[NR p + j, 2 e + t] at [e][j][t].
inline void pack_weight(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) packed[(((n / NR) * (K / 2) + k / 2) * NR + n % NR) * 2 + k % 2] = w[n * K + k];
}

using vitkit_avx512::Epilogue;

// acc += the pairs of x times the pairs of w.
VITKIT_BF16_GEMM inline void dot2(__m512& acc, __m512i x, __m512i w) {
  acc = _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}

// 16 bf16 at p as fp32 (exact).
VITKIT_BF16_GEMM inline __m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One R x NR tile: c[m][n] = bf16(bias[n] + sum_k a[m][k] w[n][k], then the epilogue); res may be c itself
// (each value is read before its own store). The panel b is 64-byte aligned.
template <int R, Epilogue E>
VITKIT_BF16_GEMM inline void tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t pairs,
                                  const float* bias, uint16_t* c, int64_t ldc, const uint16_t* res, int64_t ldr) {
  __m512 acc[MR][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
  for (int64_t e = 0; e < pairs; ++e) {
    const uint16_t* be = b + e * 2 * NR;
    const __m512i w0 = _mm512_load_si512(be), w1 = _mm512_load_si512(be + 32);
    const __m512i w2 = _mm512_load_si512(be + 64), w3 = _mm512_load_si512(be + 96);
    for (int r = 0; r < R; ++r) {
      int32_t bits;
      std::memcpy(&bits, a + r * lda + 2 * e, sizeof bits);
      const __m512i x = _mm512_set1_epi32(bits);
      dot2(acc[r][0], x, w0);
      dot2(acc[r][1], x, w1);
      dot2(acc[r][2], x, w2);
      dot2(acc[r][3], x, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      __m512 y = acc[r][j];
      if constexpr (E == Epilogue::kResidual) y = _mm512_add_ps(y, widen16(res + r * ldr + 16 * j));
      if constexpr (E == Epilogue::kGelu || E == Epilogue::kGeluTanh)
        y = vitkit_avx512::gelu512<E == Epilogue::kGeluTanh>(y);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + 16 * j), (__m256i)_mm512_cvtneps_pbh(y));
    }
}

// c (M, N) = x (M, K) W^T + b with the epilogue, on the calling thread; x, c and res with row strides lda, ldc,
// ldr (in bf16 values).
template <Epilogue E>
VITKIT_BF16_GEMM void gemm(const uint16_t* x, int64_t lda, int64_t M, int64_t K, const uint16_t* packed,
                           const float* bias, int64_t N, uint16_t* c, int64_t ldc, const uint16_t* res = nullptr,
                           int64_t ldr = 0) {
  // a block's rows (K bf16 each) within ~288 KiB of L2
  const int64_t target = std::clamp<int64_t>(288 * 1024 / (2 * K) / MR * MR, 4 * MR, 16 * MR);
  const int64_t pairs = K / 2;
  vitkit::row_blocks(0, M, MR, target, [&](int64_t m0, int64_t m1) {
    for (int64_t n = 0; n < N; n += NR) {
      const uint16_t* panel = packed + n * K;
      const float* bn = bias ? bias + n : nullptr;
      for (int64_t m = m0; m < m1; m += MR) {
        const uint16_t* rm = res ? res + m * ldr + n : nullptr;
        switch (std::min(MR, m1 - m)) {
          case 6: tile<6, E>(x + m * lda, lda, panel, pairs, bn, c + m * ldc + n, ldc, rm, ldr); break;
          case 5: tile<5, E>(x + m * lda, lda, panel, pairs, bn, c + m * ldc + n, ldc, rm, ldr); break;
          case 4: tile<4, E>(x + m * lda, lda, panel, pairs, bn, c + m * ldc + n, ldc, rm, ldr); break;
          case 3: tile<3, E>(x + m * lda, lda, panel, pairs, bn, c + m * ldc + n, ldc, rm, ldr); break;
          case 2: tile<2, E>(x + m * lda, lda, panel, pairs, bn, c + m * ldc + n, ldc, rm, ldr); break;
          default: tile<1, E>(x + m * lda, lda, panel, pairs, bn, c + m * ldc + n, ldc, rm, ldr); break;
        }
      }
    }
  });
}

}  // namespace vitkit_bf16

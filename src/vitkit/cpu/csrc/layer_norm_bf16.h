// LayerNorm over rows of bf16 for CPUs with AVX512-BF16: each row widened to fp32, its mean and variance taken
// in fp32 (two passes over the row, which stays in L1), and (x - mean) / sqrt(var + eps) * weight + bias
// rounded to bf16 (to nearest even) as it is stored. The kernel of torch.ops.vitkit.layer_norm_bf16
// (layer_norm_bf16.cpp) and of the bf16 block operator (bf16_block.cpp): the same bits in both.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu_hold.h"

#define VITKIT_AVX512_BF16_NORM __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace vitkit_bf16_norm {

// Whether this CPU runs these kernels (and the bf16 block's): AVX-512 F, BW, VL and BF16.
// static: a library built held to AVX2 (cpu_hold.h) answers no, in a process with one that answers yes.
[[maybe_unused]] static bool here() {
  static const bool ok = VITKIT_AVX512_HAS("avx512f") && VITKIT_AVX512_HAS("avx512bw") &&
                         VITKIT_AVX512_HAS("avx512vl") && VITKIT_AVX512_HAS("avx512bf16");
  return ok;
}

// The r < 16 (or 16) first lanes.
VITKIT_AVX512_BF16_NORM inline __mmask16 lanes(int64_t r) {
  return r >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << r) - 1);
}

VITKIT_AVX512_BF16_NORM inline __m512 widen(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// rows x D bf16 (x) -> rows x D bf16 (y); w, b: D floats; row: a scratch of D floats. avx512_math.h's
// layer_norm_rows in the same order (the same bits), with the widening fused into its first pass and the
// rounding into its last: calling it on a widened copy costs a pass more, 12 % of this kernel's time.
VITKIT_AVX512_BF16_NORM inline void layer_norm_rows(const uint16_t* x, int64_t rows, int64_t D, const float* w,
                                                    const float* b, float eps, float* row, uint16_t* y) {
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* xi = x + i * D;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = widen(xi + d, lanes(D - d));
      _mm512_storeu_ps(row + d, v);  // D rounded up to 16: the scratch has room
      sum = _mm512_add_ps(sum, v);
    }
    const float mean = _mm512_reduce_add_ps(sum) / static_cast<float>(D);
    const __m512 mv = _mm512_set1_ps(mean);
    __m512 sq = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 c = _mm512_maskz_sub_ps(lanes(D - d), _mm512_loadu_ps(row + d), mv);
      sq = _mm512_fmadd_ps(c, c, sq);
    }
    const float rstd = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(D) + eps);
    const __m512 rv = _mm512_set1_ps(rstd);
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = lanes(D - d);
      const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + d), mv), rv);
      const __m512 out = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(m, w + d), _mm512_maskz_loadu_ps(m, b + d));
      _mm256_mask_storeu_epi16(y + i * D + d, m, (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}
}  // namespace vitkit_bf16_norm

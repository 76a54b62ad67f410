// AVX-512 functions shared by vitkit's products and blocks (fp32_gemm.h, bf16_gemm.h, int8_gemm.h,
// block_operator.h): what a product's tile writes (Epilogue), exp, a reciprocal and GELU for the epilogues,
// LayerNorm over rows. Compiled for AVX-512F, inlined into callers compiled for it or for more (VNNI, BF16).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#define VITKIT_AVX512F __attribute__((target("avx512f")))

namespace vitkit_avx512 {

// What a product's tile writes (fp32_gemm.h, bf16_gemm.h, int8_gemm.h): y, y plus a residual read from `res`,
// or GELU(y) (exact, or its tanh approximation).
enum class Epilogue { kStore, kResidual, kGelu, kGeluTanh };

// exp(x), x clamped to [-87, 87]: Cephes' polynomial on x - n ln 2 times 2^n (vector_math.h's, in AVX-512).
VITKIT_AVX512F inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// 1 / d for d >= 1: vrcp14ps and one Newton step (about 1e-7 relative, where vdivps takes several times longer).
VITKIT_AVX512F inline __m512 reciprocal512(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}

// GELU, x Phi(x) = (x + |x| erf(|x| / sqrt 2)) / 2, erf(z) = 1 - (1 + a1 z + ... + a6 z^6)^-16 for z >= 0
// (Abramowitz and Stegun 7.1.28: absolute error under 3e-7, far below the int8 products' rounding, in a
// polynomial, a reciprocal and four squarings, half the work of an exp-based erf); with `tanh`, the tanh
// approximation x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3). Always inlined: it runs in product tiles'
// epilogues, where GCC otherwise leaves it a call that spills the tile's sums.
template <bool kTanh>
VITKIT_AVX512F inline __attribute__((always_inline)) __m512 gelu512(__m512 x) {
  if constexpr (kTanh) {
    const __m512 cubic = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f), cubic);  // -2 sqrt(2 / pi)
    return _mm512_mul_ps(x, reciprocal512(_mm512_add_ps(_mm512_set1_ps(1.f), exp512(u))));
  } else {
    // |x| / sqrt 2, clamped at 10 (erf is 1 in fp32 well before): the polynomial stays finite
    const __m512 z = _mm512_min_ps(_mm512_abs_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f))),
                                   _mm512_set1_ps(10.f));
    __m512 p = _mm512_set1_ps(0.0000430638f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.0002765672f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.0001520143f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.0092705272f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.0422820123f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(0.0705230784f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.f));
    __m512 r = reciprocal512(p);
    r = _mm512_mul_ps(r, r);
    r = _mm512_mul_ps(r, r);
    r = _mm512_mul_ps(r, r);
    r = _mm512_mul_ps(r, r);  // p^-16
    const __m512 erf_abs = _mm512_sub_ps(_mm512_set1_ps(1.f), r);
    return _mm512_mul_ps(_mm512_set1_ps(0.5f), _mm512_fmadd_ps(_mm512_abs_ps(x), erf_abs, x));
  }
}

// Rows of x (M, D, stride ldx) -> LayerNorm(x) w + b (stride ldy): mean and variance in two passes over the
// row (in L1).
VITKIT_AVX512F inline void layer_norm_rows(const float* x, int64_t ldx, int64_t M, int64_t D, const float* w,
                                       const float* b, float eps, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const float* in = x + m * ldx;
    float* out = y + m * ldy;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < D; k += 16) {
      const __mmask16 t = D - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - k)) - 1);
      sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(t, in + k));
    }
    const __m512 mu = _mm512_set1_ps(_mm512_reduce_add_ps(sum) / static_cast<float>(D));
    __m512 sq = _mm512_setzero_ps();
    for (int64_t k = 0; k < D; k += 16) {
      const __mmask16 t = D - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - k)) - 1);
      const __m512 d = _mm512_maskz_sub_ps(t, _mm512_maskz_loadu_ps(t, in + k), mu);
      sq = _mm512_fmadd_ps(d, d, sq);
    }
    const __m512 rstd = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(D) + eps));
    for (int64_t k = 0; k < D; k += 16) {
      const __mmask16 t = D - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - k)) - 1);
      const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, in + k), mu), rstd);
      _mm512_mask_storeu_ps(out + k, t,
                            _mm512_fmadd_ps(d, _mm512_maskz_loadu_ps(t, w + k), _mm512_maskz_loadu_ps(t, b + k)));
    }
  }
}

}  // namespace vitkit_avx512

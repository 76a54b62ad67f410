// vitkit's fp32 product and LayerNorm for AVX2 + FMA CPUs, for the fp32 block operator (fp32_block.cpp):
// y = x W^T + b with the residual add or GELU applied in the tile, on the calling thread (the block's region
// is already parallel).
//
// gemm.cpp's scheme: the weight packed once into panels of 16 output columns, k-major ([K][16] floats each);
// blocks of MC rows, steps of KC of the inner dimension, so that a panel's step stays in L1 and the block's
// rows in L2; 6 x 16 tiles in 12 ymm sums, each step two loads of the panel, a broadcast of each row's value
// and 12 FMAs.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "avx512_math.h"
#include "block_region.h"
#include "panels.h"

#define VITKIT_F32_AVX2 __attribute__((target("avx2,fma")))

namespace vitkit_f32_avx2 {

constexpr int64_t NR = 16;  // columns of a panel: two ymm
constexpr int64_t MR = 6;   // rows of a tile

// w (N, K) row-major, N a multiple of NR -> panels (N / NR, K, NR) (panels.h).
inline void pack_weight(const float* w, int64_t N, int64_t K, float* packed) {
  vitkit::pack_panels(w, K, NR, 0, N / NR, packed);
}

using vitkit_avx512::Epilogue;

// exp(x), x clamped to [-87, 87]: avx512_math.h's exp512 in 8-float vectors (2^n built in the exponent bits).
VITKIT_F32_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

// 1 / d for d >= 1: vrcpps (12 bits) and one Newton step.
VITKIT_F32_AVX2 inline __m256 reciprocal256(__m256 d) {
  const __m256 r = _mm256_rcp_ps(d);
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
}

VITKIT_F32_AVX2 inline __m256 abs256(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }

// GELU as avx512_math.h's gelu512 computes it (the same erf polynomial, or the tanh approximation); p^-16
// from a division, where vrcpps and a Newton step would leave 7e-7.
template <bool kTanh>
VITKIT_F32_AVX2 inline __m256 gelu256(__m256 x) {
  if constexpr (kTanh) {
    const __m256 cubic = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f), cubic);  // -2 sqrt(2 / pi)
    return _mm256_mul_ps(x, reciprocal256(_mm256_add_ps(_mm256_set1_ps(1.f), exp256(u))));
  } else {
    const __m256 z = _mm256_min_ps(abs256(_mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f))),
                                   _mm256_set1_ps(10.f));
    __m256 p = _mm256_set1_ps(0.0000430638f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0002765672f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0001520143f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0092705272f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0422820123f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0705230784f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.f));
    __m256 r = _mm256_div_ps(_mm256_set1_ps(1.f), p);  // exact: the four squarings raise its error 16-fold
    r = _mm256_mul_ps(r, r);
    r = _mm256_mul_ps(r, r);
    r = _mm256_mul_ps(r, r);
    r = _mm256_mul_ps(r, r);  // p^-16
    const __m256 erf_abs = _mm256_sub_ps(_mm256_set1_ps(1.f), r);
    return _mm256_mul_ps(_mm256_set1_ps(0.5f), _mm256_fmadd_ps(abs256(x), erf_abs, x));
  }
}

VITKIT_F32_AVX2 inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Rows of x (M, D, stride ldx) -> LayerNorm(x) w + b (stride ldy): mean and variance in two passes over the
// row (in L1); the last D % 8 values of a row one by one.
VITKIT_F32_AVX2 inline void layer_norm_rows(const float* x, int64_t ldx, int64_t M, int64_t D, const float* w,
                                            const float* b, float eps, float* y, int64_t ldy) {
  const int64_t Dv = D / 8 * 8;
  for (int64_t m = 0; m < M; ++m) {
    const float* in = x + m * ldx;
    float* out = y + m * ldy;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < Dv; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(in + k));
    float sum = sum8(acc);
    for (int64_t k = Dv; k < D; ++k) sum += in[k];
    const float mean = sum / static_cast<float>(D);
    const __m256 mu = _mm256_set1_ps(mean);
    __m256 sq = _mm256_setzero_ps();
    for (int64_t k = 0; k < Dv; k += 8) {
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(in + k), mu);
      sq = _mm256_fmadd_ps(d, d, sq);
    }
    float var = sum8(sq);
    for (int64_t k = Dv; k < D; ++k) var += (in[k] - mean) * (in[k] - mean);
    const float rstd = 1.f / std::sqrt(var / static_cast<float>(D) + eps);
    const __m256 rs = _mm256_set1_ps(rstd);
    for (int64_t k = 0; k < Dv; k += 8) {
      const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(in + k), mu), rs);
      _mm256_storeu_ps(out + k, _mm256_fmadd_ps(d, _mm256_loadu_ps(w + k), _mm256_loadu_ps(b + k)));
    }
    for (int64_t k = Dv; k < D; ++k) out[k] = (in[k] - mean) * rstd * w[k] + b[k];
  }
}

constexpr int64_t KC = 384;  // inner-dimension step: a panel's 16 x KC floats (24 KiB) stay in L1
constexpr int64_t MC = 96;   // rows a block: MC x KC of x (144 KiB) in L2

// One R x NR tile over kc steps of the inner dimension. On the first step the sums start from the bias (and,
// with the residual epilogue, the residual at `res`, which may be c itself: each value is read before its own
// store); on later ones from c. GELU is applied on the last step. The panel b is 32-byte aligned. The sums are
// named variables, not an array: GCC stored an array of them to the stack at every step.
template <int R, Epilogue E>
VITKIT_F32_AVX2 inline void tile(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t kc,
                                 const float* bias, bool first, bool last, float* c, int64_t ldc, const float* res,
                                 int64_t ldr) {
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 c00 = b0, c01 = b1, c10 = b0, c11 = b1, c20 = b0, c21 = b1;
  __m256 c30 = b0, c31 = b1, c40 = b0, c41 = b1, c50 = b0, c51 = b1;
#define VK_ROWS(X) X(0, c00, c01) X(1, c10, c11) X(2, c20, c21) X(3, c30, c31) X(4, c40, c41) X(5, c50, c51)
  if (!first) {
#define VK_LOAD(r, lo, hi) \
  if constexpr (R > r) { lo = _mm256_loadu_ps(c + r * ldc); hi = _mm256_loadu_ps(c + r * ldc + 8); }
    VK_ROWS(VK_LOAD)
#undef VK_LOAD
  } else if constexpr (E == Epilogue::kResidual) {
#define VK_RES(r, lo, hi)                                          \
  if constexpr (R > r) {                                           \
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(res + r * ldr));        \
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(res + r * ldr + 8));    \
  }
    VK_ROWS(VK_RES)
#undef VK_RES
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(b + k * NR), w1 = _mm256_load_ps(b + k * NR + 8);
#define VK_FMA(r, lo, hi)                                  \
  if constexpr (R > r) {                                   \
    const __m256 x = _mm256_broadcast_ss(a + r * lda + k); \
    lo = _mm256_fmadd_ps(x, w0, lo);                       \
    hi = _mm256_fmadd_ps(x, w1, hi);                       \
  }
    VK_ROWS(VK_FMA)
#undef VK_FMA
  }
  if constexpr (E == Epilogue::kGelu || E == Epilogue::kGeluTanh) {
    if (last) {
#define VK_GELU(r, lo, hi) \
  if constexpr (R > r) { lo = gelu256<E == Epilogue::kGeluTanh>(lo); hi = gelu256<E == Epilogue::kGeluTanh>(hi); }
      VK_ROWS(VK_GELU)
#undef VK_GELU
    }
  }
#define VK_STORE(r, lo, hi) \
  if constexpr (R > r) { _mm256_storeu_ps(c + r * ldc, lo); _mm256_storeu_ps(c + r * ldc + 8, hi); }
  VK_ROWS(VK_STORE)
#undef VK_STORE
#undef VK_ROWS
}

// c (M, N) = x (M, K) W^T + b with the epilogue, on the calling thread; x, c and res with row strides lda, ldc,
// ldr. Goto's loops (gemm.cpp's): blocks of MC rows, steps of KC of the inner dimension, every panel's step
// past the block's tiles.
template <Epilogue E>
VITKIT_F32_AVX2 void gemm(const float* x, int64_t lda, int64_t M, int64_t K, const float* packed,
                          const float* bias, int64_t N, float* c, int64_t ldc, const float* res = nullptr,
                          int64_t ldr = 0) {
  vitkit::row_blocks(0, M, MR, MC, [&](int64_t m0, int64_t m1) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      const bool first = k0 == 0, last = k0 + kc == K;
      for (int64_t n = 0; n < N; n += NR) {
        const float* panel = packed + n * K + k0 * NR;
        const float* bn = bias ? bias + n : nullptr;
        for (int64_t m = m0; m < m1; m += MR) {
          const float* am = x + m * lda + k0;
          float* cm = c + m * ldc + n;
          const float* rm = res ? res + m * ldr + n : nullptr;
          switch (std::min(MR, m1 - m)) {
            case 6: tile<6, E>(am, lda, panel, kc, bn, first, last, cm, ldc, rm, ldr); break;
            case 5: tile<5, E>(am, lda, panel, kc, bn, first, last, cm, ldc, rm, ldr); break;
            case 4: tile<4, E>(am, lda, panel, kc, bn, first, last, cm, ldc, rm, ldr); break;
            case 3: tile<3, E>(am, lda, panel, kc, bn, first, last, cm, ldc, rm, ldr); break;
            case 2: tile<2, E>(am, lda, panel, kc, bn, first, last, cm, ldc, rm, ldr); break;
            default: tile<1, E>(am, lda, panel, kc, bn, first, last, cm, ldc, rm, ldr); break;
          }
        }
      }
    }
  });
}

}  // namespace vitkit_f32_avx2

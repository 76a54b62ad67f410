// vitkit's int8 product for CPUs with AVX512-VNNI: y = x W^T + b with x quantised per row and W per output
// channel, both symmetric to 8 bits, summed in int32 by vpdpbusd and scaled back to fp32 in the tile.
//
// vpdpbusd multiplies unsigned bytes by signed ones, four pairs a lane: the rows are stored as q + 128 (u8) and
// the 128 sum_k w[n][k] this adds is taken off per column in the epilogue. The weight is packed once into
// panels of 64 output columns, each [K/4][64][4] bytes (four zmm per group of four inner steps); a tile is 6
// rows x 64 columns in 24 zmm sums, each step four weight loads, six broadcasts of a row's four bytes and 24
// vpdpbusd. A panel of the weight (K x 64 bytes: 24 KiB for K = 384) stays in L1/L2 while the tiles walk down
// the rows; no blocking of K is needed, since each 256 bytes of weight feed 24 instructions. On an AMD EPYC
// (Zen 4), 2 threads, ViT-S/16's layers at 197 rows: 84-86 % of vpdpbusd's peak including the rows'
// quantisation (PyTorch's dynamic int8 linear, fbgemm or oneDNN: 67-73 %); benchmarks/bench_peak.py.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "avx512_math.h"

#define VITKIT_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

namespace vitkit_i8 {

constexpr int64_t NR = 64;  // columns of a panel: four zmm of 16 int32 sums
constexpr int64_t MR = 6;   // rows of a tile: 24 sums + 4 weights + 1 broadcast of 32 zmm

inline int64_t padded_k(int64_t k) { return (k + 3) / 4 * 4; }
inline int64_t padded_n(int64_t n) { return (n + NR - 1) / NR * NR; }

// w (N, K) int8 row-major -> panels of NR columns, each [K/4][NR][4] bytes (zeros past N and K); colsum[n] =
// sum_k w[n][k] for the N columns.
inline void pack_weight(const int8_t* w, int64_t N, int64_t K, int8_t* packed, int32_t* colsum) {
  const int64_t Kp = padded_k(K), Np = padded_n(N);
  std::memset(packed, 0, Np * Kp);
  for (int64_t n = 0; n < N; ++n) {
    int32_t s = 0;
    const int64_t panel = n / NR, c = n % NR;
    int8_t* dst = packed + panel * NR * Kp;
    for (int64_t k = 0; k < K; ++k) {
      dst[(k / 4) * NR * 4 + c * 4 + k % 4] = w[n * K + k];
      s += w[n * K + k];
    }
    colsum[n] = s;
  }
}

// Rows of x (M, K) fp32 -> u8 rows of Kp = padded_k(K) bytes (stride ldq), one symmetric scale per row:
// q = round(x / s) + 128 with s = max |x| / 127 (1 for a row of zeros); the padding holds 128, the zero.
VITKIT_VNNI inline void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, uint8_t* q, int64_t ldq,
                                      float* scales) {
  const int64_t Kp = padded_k(K);
  const __mmask16 all = 0xFFFF;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;  // vmaxps drops a NaN: they are looked for on their own
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 t = K - k >= 16 ? all : (__mmask16)((1u << (K - k)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(t, row + k);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float a = _mm512_reduce_max_ps(amax);
    // a row with a NaN gets a NaN scale, which its outputs carry, as the fp32 product's would
    const float s = nan ? std::nanf("") : a > 0.f ? a / 127.f : 1.f;
    scales[m] = s;
    const __m512 inv = _mm512_set1_ps(1.f / s);
    const __m512i off = _mm512_set1_epi32(128);
    uint8_t* out = q + m * ldq;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 t = K - k >= 16 ? all : (__mmask16)((1u << (K - k)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(t, row + k);
      const __m512i i = _mm512_add_epi32(
          _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), off);
      _mm_mask_storeu_epi8(out + k, t, _mm512_cvtusepi32_epi8(i));
    }
    for (int64_t k = K; k < Kp; ++k) out[k] = 128;
  }
}

// Rows of x (M, D) -> LayerNorm(x) w + b, quantised as quantize_rows does (into q, stride ldq, and scales),
// each row normalised and quantised while it is in L1; `row` is scratch for one row of D floats.
VITKIT_VNNI inline void layer_norm_quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t D,
                                                 const float* w, const float* b, float eps, float* row, uint8_t* q,
                                                 int64_t ldq, float* scales) {
  for (int64_t m = 0; m < M; ++m) {
    vitkit_avx512::layer_norm_rows(x + m * ldx, ldx, 1, D, w, b, eps, row, D);
    quantize_rows(row, D, 1, D, q + m * ldq, ldq, scales + m);
  }
}

// acc += u8 x s8 in four-byte groups, in place: GCC 12 copies and spills the accumulators of the intrinsic
// (_mm512_dpbusd_epi32) in a loop of 24 of them; the one instruction as asm keeps each in its register.
VITKIT_VNNI inline void dot4(__m512i& acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
}

using vitkit_avx512::Epilogue;

// The masked lanes of 16 floats at p, as they are, or rounded to bf16 (to nearest even, a NaN stored as the quiet
// NaN 0x7FC0) in integer arithmetic: this code is compiled for VNNI, whose CPUs need not have AVX512-BF16.
VITKIT_VNNI inline void store(float* p, __mmask16 t, __m512 y) { _mm512_mask_storeu_ps(p, t, y); }
VITKIT_VNNI inline void store(uint16_t* p, __mmask16 t, __m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, t, _mm512_cvtepi32_epi16(h));
}

// One R x NR tile (ncols <= NR of its columns stored): c[m][n] = (sum_k q[m][k] w[n][k] - 128 colsum[n]) sa[m]
// sb[n] + bias[n] (+ res[m][n]), fp32 or rounded to bf16 (Out = uint16_t); q holds x / sa + 128.
template <int R, Epilogue E, typename Out>
VITKIT_VNNI inline void tile(const uint8_t* a, int64_t lda, const int8_t* b, int64_t kg, const int32_t* colsum,
                             const float* sa, const float* sb, const float* bias, Out* c, int64_t ldc,
                             const float* res, int64_t ldr, int64_t ncols) {
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00,
          c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00,
          c40 = c00, c41 = c00, c42 = c00, c43 = c00, c50 = c00, c51 = c00, c52 = c00, c53 = c00;
#define VK_ROWS(X) X(0, c00, c01, c02, c03) X(1, c10, c11, c12, c13) X(2, c20, c21, c22, c23) \
                   X(3, c30, c31, c32, c33) X(4, c40, c41, c42, c43) X(5, c50, c51, c52, c53)
  const uint8_t* ap = a;
  for (int64_t g = 0; g < kg; ++g, ap += 4) {
    const __m512i b0 = _mm512_loadu_si512(b + g * 256), b1 = _mm512_loadu_si512(b + g * 256 + 64);
    const __m512i b2 = _mm512_loadu_si512(b + g * 256 + 128), b3 = _mm512_loadu_si512(b + g * 256 + 192);
#define VK_DOT(r, x0, x1, x2, x3)                                                            \
  if constexpr (R > r) {                                                                     \
    int32_t word;                                                                            \
    std::memcpy(&word, ap + r * lda, 4);                                                     \
    const __m512i x = _mm512_set1_epi32(word);                                               \
    dot4(x0, x, b0);                                                                         \
    dot4(x1, x, b1);                                                                         \
    dot4(x2, x, b2);                                                                         \
    dot4(x3, x, b3);                                                                         \
  }
    VK_ROWS(VK_DOT)
#undef VK_DOT
  }
  const auto mask = [ncols](int64_t n0) {
    const int64_t left = ncols - n0;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
  };
  const __mmask16 t0 = mask(0), t1 = mask(16), t2 = mask(32), t3 = mask(48);
  const __m512i cs0 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(t0, colsum), 7);
  const __m512i cs1 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(t1, colsum + 16), 7);
  const __m512i cs2 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(t2, colsum + 32), 7);
  const __m512i cs3 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(t3, colsum + 48), 7);
  const __m512 w0 = _mm512_maskz_loadu_ps(t0, sb), w1 = _mm512_maskz_loadu_ps(t1, sb + 16);
  const __m512 w2 = _mm512_maskz_loadu_ps(t2, sb + 32), w3 = _mm512_maskz_loadu_ps(t3, sb + 48);
  const __m512 z = _mm512_setzero_ps();
  const __m512 bb0 = bias ? _mm512_maskz_loadu_ps(t0, bias) : z;
  const __m512 bb1 = bias ? _mm512_maskz_loadu_ps(t1, bias + 16) : z;
  const __m512 bb2 = bias ? _mm512_maskz_loadu_ps(t2, bias + 32) : z;
  const __m512 bb3 = bias ? _mm512_maskz_loadu_ps(t3, bias + 48) : z;
#define VK_ONE(r, x, cs, w, bb, t, n0)                                                                \
  {                                                                                                   \
    __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(x, cs)), _mm512_mul_ps(w, s), bb); \
    if constexpr (E == Epilogue::kResidual)                                                           \
      y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(t, res + r * ldr + n0));                             \
    if constexpr (E == Epilogue::kGelu || E == Epilogue::kGeluTanh)                                   \
      y = vitkit_avx512::gelu512<E == Epilogue::kGeluTanh>(y);                                        \
    store(c + r * ldc + n0, t, y);                                                                    \
  }
#define VK_OUT(r, x0, x1, x2, x3)                   \
  if constexpr (R > r) {                            \
    const __m512 s = _mm512_set1_ps(sa[r]);         \
    VK_ONE(r, x0, cs0, w0, bb0, t0, 0)              \
    VK_ONE(r, x1, cs1, w1, bb1, t1, 16)             \
    VK_ONE(r, x2, cs2, w2, bb2, t2, 32)             \
    VK_ONE(r, x3, cs3, w3, bb3, t3, 48)             \
  }
  VK_ROWS(VK_OUT)
#undef VK_OUT
#undef VK_ONE
#undef VK_ROWS
  static_assert(std::is_same_v<Out, float> || !(E == Epilogue::kGelu || E == Epilogue::kGeluTanh),
                "GELU's tiles are fp32");
}

// c (M, N) = the products of the quantised rows q (M rows of Kp bytes, stride lda) with the packed weight,
// on the calling thread; c fp32, or bf16 (Out = uint16_t).
template <Epilogue E, typename Out = float>
VITKIT_VNNI void gemm(const uint8_t* q, int64_t lda, int64_t M, int64_t Kp, const float* sa, const int8_t* packed,
                      const int32_t* colsum, const float* sb, const float* bias, int64_t N, Out* c, int64_t ldc,
                      const float* res, int64_t ldr) {
  const int64_t kg = Kp / 4;
  for (int64_t n0 = 0; n0 < N; n0 += NR) {
    const int8_t* panel = packed + (n0 / NR) * NR * Kp;
    const int64_t nc = std::min(NR, N - n0);
    const float* bn = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
      tile<MR, E, Out>(q + m * lda, lda, panel, kg, colsum + n0, sa + m, sb + n0, bn, c + m * ldc + n0, ldc,
                       res ? res + m * ldr + n0 : nullptr, ldr, nc);
    const int64_t left = M - m;
#define VK_TAIL(R)                                                                                           \
  if (left == R)                                                                                             \
    tile<R, E, Out>(q + m * lda, lda, panel, kg, colsum + n0, sa + m, sb + n0, bn, c + m * ldc + n0, ldc,    \
                    res ? res + m * ldr + n0 : nullptr, ldr, nc);
    VK_TAIL(1) VK_TAIL(2) VK_TAIL(3) VK_TAIL(4) VK_TAIL(5)
#undef VK_TAIL
  }
}

}  // namespace vitkit_i8

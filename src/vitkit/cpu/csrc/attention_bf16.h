// The int8 block's attention in bf16 on AVX512-BF16 register tiles: attention_kernels.h's tiled forward with
// q, k, v and the softmax rounded to bf16 and every product accumulated in fp32 by vdpbf16ps, which does two
// multiply-adds a lane where vfmadd231ps does one. For inference only (no log-sum-exp, no backward).
//
// vdpbf16ps multiplies pairs: lane l of the result gains a[2l] b[2l] + a[2l + 1] b[2l + 1]. So each operand
// is stored as pairs along the dimension summed over, and one side is a broadcast pair:
//
//   scores  S^T (keys down, 16 queries a vector) = K (scale Q)^T: a key's pair of dims broadcast against
//           16 queries' same pair (q packed as qp[e][i][2], e the pair of dims);
//   values  O = P V / rowsum: a query's pair of keys broadcast against 16 dims of the same two keys' rows of
//           V (v packed as vp[j'][d][2], j' the pair of keys; an odd T's last pair padded with a zero key).
//
// The softmax runs in fp32 on the scores as attention_kernels.h's does, its exp to about 3e-6 (bf16 rounds to
// 2^-9); its unnormalised terms, in [0, 1], are what gets rounded to bf16, and the sum they are divided by
// stays fp32.
//
// The projection may come in fp32 (the int8 block's) or in bf16 (a bf16 model's, read in place: its k rows
// are the scores' operand as they are), and the output go out in either: the same bits as the bf16 input
// cast to fp32 and the fp32 output rounded to bf16 (to nearest even, as the cast does), without the copies.

#pragma once

#include <type_traits>

#include "attention_kernels.h"

#if defined(__x86_64__)

namespace {

#define VITKIT_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// 32 bf16, a's 16 low and b's 16 high, as lane pairs: out[2l] = a[l], out[2l + 1] = b[l].
VITKIT_AVX512_BF16 VITKIT_INLINE __m512i interleave_halves(__m512i halves) {
  alignas(64) static const int16_t kOrder[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kOrder), halves);
}

// Lane pairs of two rows of 16 floats as 32 bf16: out[2l] = a[l], out[2l + 1] = b[l] (rounded to nearest even).
VITKIT_AVX512_BF16 VITKIT_INLINE __m512i interleave_bf16(__m512 a, __m512 b) {
  return interleave_halves((__m512i)_mm512_cvtne2ps_pbh(b, a));
}

VITKIT_AVX512_BF16 VITKIT_INLINE __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// The 32 bits at p (a pair of bf16) in every lane.
VITKIT_AVX512_BF16 VITKIT_INLINE __m512bh broadcast_pair(const uint16_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return as_bh(_mm512_set1_epi32(bits));
}

// 16 floats stored as they are, or rounded to bf16 (to nearest even).
VITKIT_AVX512_BF16 VITKIT_INLINE void store_row(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
VITKIT_AVX512_BF16 VITKIT_INLINE void store_row(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// st[r * ldst + 16 c + l] = sum_d k[r * ldk + d] q(d, 16 c + l): RJ keys (bf16 rows) by NQ vectors of queries
// (qp: pairs of dims e, then queries, n of them).
template <int RJ, int NQ>
VITKIT_AVX512_BF16 VITKIT_INLINE void scores_tile_bf16(const uint16_t* k, int64_t ldk, const uint16_t* qp,
                                                       int64_t n, int64_t pairs, float* st, int64_t ldst) {
  __m512 acc[RJ][NQ];
  for (int r = 0; r < RJ; ++r)
    for (int c = 0; c < NQ; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t e = 0; e < pairs; ++e) {
    __m512bh qv[NQ];
    for (int c = 0; c < NQ; ++c) qv[c] = as_bh(_mm512_loadu_si512(qp + (e * n + 16 * c) * 2));
    for (int r = 0; r < RJ; ++r) {
      const __m512bh kb = broadcast_pair(k + r * ldk + 2 * e);
      for (int c = 0; c < NQ; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kb, qv[c]);
    }
  }
  for (int r = 0; r < RJ; ++r)
    for (int c = 0; c < NQ; ++c) _mm512_storeu_ps(st + r * ldst + 16 * c, acc[r][c]);
}

// All T keys against NQ query vectors, six keys at a time.
template <int NQ>
VITKIT_AVX512_BF16 void scores_columns_bf16(const uint16_t* k, int64_t ldk, int64_t T, const uint16_t* qp,
                                            int64_t n, int64_t pairs, float* st, int64_t ldst) {
  int64_t j = 0;
  for (; j + 6 <= T; j += 6) scores_tile_bf16<6, NQ>(k + j * ldk, ldk, qp, n, pairs, st + j * ldst, ldst);
  const uint16_t* kj = k + j * ldk;
  float* sj = st + j * ldst;
  switch (T - j) {
    case 5: scores_tile_bf16<5, NQ>(kj, ldk, qp, n, pairs, sj, ldst); break;
    case 4: scores_tile_bf16<4, NQ>(kj, ldk, qp, n, pairs, sj, ldst); break;
    case 3: scores_tile_bf16<3, NQ>(kj, ldk, qp, n, pairs, sj, ldst); break;
    case 2: scores_tile_bf16<2, NQ>(kj, ldk, qp, n, pairs, sj, ldst); break;
    case 1: scores_tile_bf16<1, NQ>(kj, ldk, qp, n, pairs, sj, ldst); break;
    default: break;
  }
}

// o[r * ldo + 16 c + l] = inv[r] sum_j' p(r, j') . vp(j', 16 c + l): RI queries by DV vectors of dims, pp and
// vp in pairs of keys (pp: pairs, then queries, n of them; vp: pairs, then D dims).
template <int RI, int DV, typename Out>
VITKIT_AVX512_BF16 VITKIT_INLINE void values_tile_bf16(const uint16_t* pp, int64_t n, const uint16_t* vp,
                                                       int64_t D, int64_t pairs, const float* inv, Out* o,
                                                       int64_t ldo) {
  __m512 acc[RI][DV];
  for (int r = 0; r < RI; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t e = 0; e < pairs; ++e) {
    __m512bh vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = as_bh(_mm512_loadu_si512(vp + (e * D + 16 * c) * 2));
    for (int r = 0; r < RI; ++r) {
      const __m512bh pb = broadcast_pair(pp + (e * n + r) * 2);
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
    }
  }
  for (int r = 0; r < RI; ++r) {
    const __m512 f = _mm512_set1_ps(inv[r]);
    for (int c = 0; c < DV; ++c) store_row(o + r * ldo + 16 * c, _mm512_mul_ps(acc[r][c], f));
  }
}

// All `rows` queries, RI at a time (as many as keep RI x DV accumulators within 24 registers).
template <int DV, typename Out>
VITKIT_AVX512_BF16 void values_rows_bf16(const uint16_t* pp, int64_t n, const uint16_t* vp, int64_t D,
                                         int64_t pairs, int64_t rows, const float* inv, Out* o, int64_t ldo) {
  constexpr int RI = DV <= 4 ? 6 : DV <= 6 ? 4 : 3;
  int64_t i = 0;
  for (; i + RI <= rows; i += RI) values_tile_bf16<RI, DV>(pp + 2 * i, n, vp, D, pairs, inv + i, o + i * ldo, ldo);
  const uint16_t* pi = pp + 2 * i;
  Out* oi = o + i * ldo;
  switch (rows - i) {
    case 5: if constexpr (RI > 5) values_tile_bf16<5, DV>(pi, n, vp, D, pairs, inv + i, oi, ldo); break;
    case 4: if constexpr (RI > 4) values_tile_bf16<4, DV>(pi, n, vp, D, pairs, inv + i, oi, ldo); break;
    case 3: if constexpr (RI > 3) values_tile_bf16<3, DV>(pi, n, vp, D, pairs, inv + i, oi, ldo); break;
    case 2: values_tile_bf16<2, DV>(pi, n, vp, D, pairs, inv + i, oi, ldo); break;
    case 1: values_tile_bf16<1, DV>(pi, n, vp, D, pairs, inv + i, oi, ldo); break;
    default: break;
  }
}

// (rows x D) = P V / rowsum (values_tile_bf16), for D = 16 to 128.
template <typename Out>
VITKIT_AVX512_BF16 void values_bf16(const uint16_t* pp, int64_t n, const uint16_t* vp, int64_t D, int64_t pairs,
                                    int64_t rows, const float* inv, Out* o, int64_t ldo) {
  switch (D / kWidth) {
    case 1: values_rows_bf16<1>(pp, n, vp, D, pairs, rows, inv, o, ldo); break;
    case 2: values_rows_bf16<2>(pp, n, vp, D, pairs, rows, inv, o, ldo); break;
    case 3: values_rows_bf16<3>(pp, n, vp, D, pairs, rows, inv, o, ldo); break;
    case 4: values_rows_bf16<4>(pp, n, vp, D, pairs, rows, inv, o, ldo); break;
    case 5: values_rows_bf16<5>(pp, n, vp, D, pairs, rows, inv, o, ldo); break;
    case 6: values_rows_bf16<6>(pp, n, vp, D, pairs, rows, inv, o, ldo); break;
    case 7: values_rows_bf16<7>(pp, n, vp, D, pairs, rows, inv, o, ldo); break;
    default: values_rows_bf16<8>(pp, n, vp, D, pairs, rows, inv, o, ldo); break;
  }
}

// out[(e * n + i) * 2 + t] = rows[(2 e + t) * n + i]: `count` rows of n floats (n a multiple of 16) as pairs
// of rows in bf16, a zero row after an odd count.
VITKIT_AVX512_BF16 void pair_rows_bf16(const float* rows, int64_t count, int64_t n, uint16_t* out) {
  for (int64_t e = 0; 2 * e < count; ++e) {
    const float* a = rows + 2 * e * n;
    for (int64_t i = 0; i < n; i += kWidth) {
      const __m512 b = 2 * e + 1 < count ? _mm512_loadu_ps(a + n + i) : _mm512_setzero_ps();
      _mm512_storeu_si512(out + (e * n + i) * 2, interleave_bf16(_mm512_loadu_ps(a + i), b));
    }
  }
}

// exp(x) for x = s - max <= 0, as 2^t with t = x log2 e = n + f, n an integer and |f| <= 1/2: a degree-4
// polynomial for 2^f (1 + f (...), fitted to the least relative error on [-1/2, 1/2]: 2.8e-6), scaled by 2^n
// in one vscalefps, which gives 0 where 2^n underflows. exp(0) is exactly 1; t is clamped at -150 (2^-150 is 0
// in fp32), so that a score of -inf gives 0, not -inf - -inf.
VITKIT_AVX512_BF16 VITKIT_INLINE __m512 exp_shifted(__m512 s, __m512 mx) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(s, mx), _mm512_set1_ps(1.44269504088896341f)),
                                 _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.582852945e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.590642616e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402409911e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931241751e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// softmax_columns (attention_kernels.h) for the n queries of st (T keys down, row stride n), written straight
// as pair_rows_bf16 would pair its rows: pp[(e * n + i) * 2 + t] = exp(st[(2 e + t) n + i] - max_i) in bf16
// (a zero key after an odd T), and inv[i] = 1 / the fp32 sum of the terms. One pass fewer over the scores
// than the two steps, which stored the terms in fp32 to read them again; no log-sum-exp (no backward here).
// On an AMD EPYC (Zen 4), one thread, ViT-S/16's pairs: with exp_shifted (10 instructions) the attention took
// 71.8 us a pair at best against 73.5 with vector_math.h's exp (about 18).
VITKIT_AVX512_BF16 void softmax_pairs_bf16(const float* st, int64_t n, int64_t T, uint16_t* pp, float* inv) {
  for (int64_t c = 0; c < n; c += kWidth) {
    const float* col = st + c;
    __m512 mx = _mm512_loadu_ps(col);
    for (int64_t j = 1; j < T; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(col + j * n));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t e = 0; 2 * e < T; ++e) {
      const __m512 a = exp_shifted(_mm512_loadu_ps(col + 2 * e * n), mx);
      const __m512 b = 2 * e + 1 < T ? exp_shifted(_mm512_loadu_ps(col + (2 * e + 1) * n), mx)
                                     : _mm512_setzero_ps();
      sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
      _mm512_storeu_si512(pp + (e * n + c) * 2, interleave_bf16(a, b));
    }
    _mm512_storeu_ps(inv + c, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
  }
}

// One (image, head) pair's k in bf16 (T x D, rows as they are) and v as pairs of keys (vp), from the fp32
// rows of the projection (row stride ld).
VITKIT_AVX512_BF16 void pack_keys_values_bf16(const float* k, const float* v, int64_t ld, int64_t T, int64_t D,
                                              uint16_t* kb, uint16_t* vp) {
  for (int64_t j = 0; j < T; ++j)
    for (int64_t d = 0; d < D; d += kWidth)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(kb + j * D + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(k + j * ld + d)));
  for (int64_t e = 0; 2 * e < T; ++e)
    for (int64_t d = 0; d < D; d += kWidth) {
      const __m512 b = 2 * e + 1 < T ? _mm512_loadu_ps(v + (2 * e + 1) * ld + d) : _mm512_setzero_ps();
      _mm512_storeu_si512(vp + (e * D + d) * 2, interleave_bf16(_mm512_loadu_ps(v + 2 * e * ld + d), b));
    }
}

// The same from a bf16 projection: v as pairs of keys; k needs no packing (its rows are read in place).
VITKIT_AVX512_BF16 void pack_keys_values_bf16(const uint16_t*, const uint16_t* v, int64_t ld, int64_t T,
                                              int64_t D, uint16_t*, uint16_t* vp) {
  for (int64_t e = 0; 2 * e < T; ++e)
    for (int64_t d = 0; d < D; d += kWidth) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 2 * e * ld + d));
      const __m256i b = 2 * e + 1 < T
                            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (2 * e + 1) * ld + d))
                            : _mm256_setzero_si256();
      _mm512_storeu_si512(vp + (e * D + d) * 2,
                          interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
    }
}

// m rows of D bf16 (row stride ld) as fp32 (row stride D): exact.
VITKIT_AVX512_BF16 void widen_rows_bf16(const uint16_t* a, int64_t ld, int64_t m, int64_t D, float* out) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t d = 0; d < D; d += kWidth) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i * ld + d));
      _mm512_storeu_ps(out + i * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
}

// One block of m query rows of one pair against its keys (kb, row stride ldk) and packed values: o (m x D, row
// stride ldo). q and o are fp32, or bf16 as uint16_t.
template <typename In, typename Out>
VITKIT_AVX512_BF16 void attention_block_bf16(const In* q, int64_t ld, const uint16_t* kb, int64_t ldk,
                                             const uint16_t* vp, int64_t T, int64_t m, int64_t D, float scale,
                                             Out* o, int64_t ldo, std::vector<float>& scratch,
                                             std::vector<uint16_t>& halves) {
  const int64_t n = (m + kWidth - 1) / kWidth * kWidth;  // queries, padded to whole vectors
  const int64_t key_pairs = (T + 1) / 2;
  constexpr bool kWiden = std::is_same_v<In, uint16_t>;
  scratch.resize(D * n + T * n + n + (kWiden ? m * D : 0));
  halves.resize(D * n + 2 * key_pairs * n);
  float* qt = scratch.data();
  float* st = qt + D * n;
  float* inv = st + T * n;
  uint16_t* qp = halves.data();
  uint16_t* pp = qp + D * n;
  if constexpr (kWiden) {
    float* rows = inv + n;
    widen_rows_bf16(q, ld, m, D, rows);
    pack_transposed(rows, D, m, n, D, scale, qt);  // scale Q^T, fp32 (attention_kernels.h)
  } else {
    pack_transposed(q, ld, m, n, D, scale, qt);
  }
  pair_rows_bf16(qt, D, n, qp);
  for (int64_t c = 0; c < n; c += 4 * kWidth) {  // S^T: keys down, queries across
    switch (std::min<int64_t>(4, (n - c) / kWidth)) {
      case 4: scores_columns_bf16<4>(kb, ldk, T, qp + 2 * c, n, D / 2, st + c, n); break;
      case 3: scores_columns_bf16<3>(kb, ldk, T, qp + 2 * c, n, D / 2, st + c, n); break;
      case 2: scores_columns_bf16<2>(kb, ldk, T, qp + 2 * c, n, D / 2, st + c, n); break;
      default: scores_columns_bf16<1>(kb, ldk, T, qp + 2 * c, n, D / 2, st + c, n); break;
    }
  }
  softmax_pairs_bf16(st, n, T, pp, inv);
  values_bf16(pp, n, vp, D, key_pairs, m, inv, o, ldo);
}

// Whether the bf16 tiles serve this head width on this CPU (AVX512-BF16, heads of 16 to 128 dims in
// multiples of 16).
bool bf16_tiles_apply(int64_t D) {
  static const bool bf16 = VITKIT_AVX512_HAS("avx512bf16") && VITKIT_AVX512_HAS("avx512bw");
  return bf16 && tiles_apply(D);
}

// attention_pairs (attention_kernels.h) on the bf16 tiles: the (image, head) pairs [p0, p1) of the q;k;v
// projection `qkv` (B, T, 3C), fp32 or bf16 (as uint16_t), written into `out` (B, T, C), fp32 or bf16, on the
// calling thread alone. Needs bf16_tiles_apply(C / heads).
template <typename In, typename Out>
void attention_pairs_bf16(const In* qkv, int64_t T, int64_t C, int64_t heads, int64_t p0, int64_t p1, float scale,
                          Out* out) {
  constexpr bool kInPlace = std::is_same_v<In, uint16_t>;  // k's rows as they are
  const int64_t D = C / heads, bm = tiled_block_rows(T);
  std::vector<float> scratch;
  std::vector<uint16_t> halves, kb(kInPlace ? 0 : T * D), vp((T + 1) / 2 * 2 * D);
  for (int64_t pair = p0; pair < p1; ++pair) {
    const int64_t b = pair / heads, h = pair % heads;
    const In* q = qkv + b * T * 3 * C + h * D;
    pack_keys_values_bf16(q + C, q + 2 * C, 3 * C, T, D, kb.data(), vp.data());
    const uint16_t* keys = nullptr;
    if constexpr (kInPlace) keys = q + C;
    else keys = kb.data();
    for (int64_t r0 = 0; r0 < T; r0 += bm) {
      const int64_t m = std::min(bm, T - r0);
      attention_block_bf16(q + r0 * 3 * C, 3 * C, keys, kInPlace ? 3 * C : D, vp.data(), T, m, D, scale,
                           out + (b * T + r0) * C + h * D, C, scratch, halves);
    }
  }
}

}  // namespace

#else
namespace {
bool bf16_tiles_apply(int64_t) { return false; }
template <typename In, typename Out>
void attention_pairs_bf16(const In*, int64_t, int64_t, int64_t, int64_t, int64_t, float, Out*) {}
}  // namespace
#endif

// The kernels of vitkit's fp32 attention on the CPU, shared by attention.cpp's operators and the int8 block
// (int8_block.cpp): one block of query rows of one (image, head) pair, forward, and one pair's backward, on
// AVX-512 register tiles where they apply and on MKL's sgemm elsewhere; `attention_pairs` runs whole pairs on
// the calling thread. Everything here has internal linkage: each operator library compiles its own copy.
//
// Layout (attention.cpp's header): q, k and v are strided views of the fused q;k;v projection (B, T, 3C), row
// stride 3C; the output is the merged heads (B, T, C).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "vector_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif


// The Fortran BLAS entry point of the MKL that libtorch_cpu links in (the same sgemm as torch.mm).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

using namespace vitkit_vec;

// C = alpha op(A) op(B) + beta C for row-major matrices: C (m x n, row stride ldc), op(A) m x k, op(B) k x n.
// (Column-major BLAS sees the transposes, so it computes C^T = op(B)^T op(A)^T.)
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
  sgemm_(&tb, &ta, &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
}

// Rows of scores, vectorised (vector_math.h): each a body run on the widest vectors this CPU has (`widest`).

// row <- softmax(row); returns the row's log-sum-exp.
struct SoftmaxRow {
  template <class V>
  static VITKIT_INLINE float run(float* row, int64_t n) {
    constexpr int64_t W = lanes<V>;
    const int64_t nv = n / W * W;
    float mx = -INFINITY;
    if (nv > 0) {
      V m = load<V>(row);
      for (int64_t i = W; i < nv; i += W) {
        const V v = load<V>(row + i);
        m = v > m ? v : m;
      }
      mx = max_lanes(m);
    }
    for (int64_t i = nv; i < n; ++i) mx = row[i] > mx ? row[i] : mx;
    V acc = {};
    for (int64_t i = 0; i < nv; i += W) {
      const V e = exp_nonpositive(load<V>(row + i) - mx);
      store(row + i, e);
      acc += e;
    }
    float sum = sum_lanes(acc);
    for (int64_t i = nv; i < n; ++i) {
      row[i] = std::exp(row[i] - mx);
      sum += row[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < nv; i += W) store(row + i, load<V>(row + i) * inv);
    for (int64_t i = nv; i < n; ++i) row[i] *= inv;
    return mx + std::log(sum);
  }
};

// row <- exp(row - lse): the softmax again from the scores and the saved log-sum-exp.
struct SoftmaxAgain {
  template <class V>
  static VITKIT_INLINE void run(float* row, int64_t n, float lse) {
    constexpr int64_t W = lanes<V>;
    const int64_t nv = n / W * W;
    for (int64_t i = 0; i < nv; i += W) store(row + i, exp_nonpositive(load<V>(row + i) - lse));
    for (int64_t i = nv; i < n; ++i) row[i] = std::exp(row[i] - lse);
  }
};

struct Dot {
  template <class V>
  static VITKIT_INLINE float run(const float* a, const float* b, int64_t n) {
    constexpr int64_t W = lanes<V>;
    const int64_t nv = n / W * W;
    V acc = {};
    for (int64_t i = 0; i < nv; i += W) acc += load<V>(a + i) * load<V>(b + i);
    float s = sum_lanes(acc);
    for (int64_t i = nv; i < n; ++i) s += a[i] * b[i];
    return s;
  }
};

// dp <- p * (dp - d): the softmax's backward for one row, d = rowsum(dO * O) = rowsum(P * dP).
struct SoftmaxBackwardRow {
  template <class V>
  static VITKIT_INLINE void run(const float* p, float* dp, int64_t n, float d) {
    constexpr int64_t W = lanes<V>;
    const int64_t nv = n / W * W;
    for (int64_t i = 0; i < nv; i += W) store(dp + i, load<V>(p + i) * (load<V>(dp + i) - d));
    for (int64_t i = nv; i < n; ++i) dp[i] = p[i] * (dp[i] - d);
  }
};

// The floats a row loop takes at a time on this CPU (16, 8 or 4): which of `widest`'s paths runs.
struct RowWidth {
  template <class V>
  static VITKIT_INLINE int64_t run() {
    return lanes<V>;
  }
};

float softmax_row(float* row, int64_t n) { return widest<SoftmaxRow>(row, n); }
void softmax_again(float* row, int64_t n, float lse) { widest<SoftmaxAgain>(row, n, lse); }
float dot(const float* a, const float* b, int64_t n) { return widest<Dot>(a, b, n); }
void softmax_backward_row(const float* p, float* dp, int64_t n, float d) {
  widest<SoftmaxBackwardRow>(p, dp, n, d);
}

// Query rows per block: the block's scores (and, in the backward, their gradient) stay in the cache: 2 x 128 x
// 577 floats (384 px) is 0.6 MB. Blocks of one pair are even: 197 tokens make 99 + 98 rows. (For ViT-S/16, blocks
// of 128 rows and of all 197 ran the same speed, of 64 rows ~8 % slower, forward and backward.)
constexpr int64_t kMaxBlock = 128;

int64_t block_rows(int64_t T) {
  const int64_t blocks = (T + kMaxBlock - 1) / kMaxBlock;
  return (T + blocks - 1) / blocks;
}

#if defined(__x86_64__)
// The products on AVX-512 registers, for heads of 16 to 128 dims in multiples of 16. sgemm pays, per call, a
// packing of both operands and a dispatch that these small products (a block of ~100 query rows against ~200
// keys, 64 deep) feel; here a task packs one operand, transposed (and scaled), and runs two register tiles:
//
//   scores_tile  rows of A against vectors of 16 columns of B^T: each row's scalars broadcast, 6 x 4 vectors;
//   values_tile  rows of coefficients against rows of V: each coefficient broadcast, up to 6 x 4 vectors.
//
// The forward computes S^T = K (scale Q)^T (keys down, 16 queries in each vector), so the softmax over the keys
// is elementwise down the rows, with no tail, then O = P V / rowsum. The backward takes a whole pair at once:
// dP = dO V^T in the first tile, dV, dQ and dK in the second, reading P and dS as stored or transposed. The rows
// of Q, K and V are read in place from the projection. (What they buy over sgemm: docs/speed.md.)
#define VITKIT_AVX512 __attribute__((target("avx512f")))

// Query vectors per block: blocks of whole vectors, as even as they come, each at most kMaxBlock rows.
int64_t tiled_block_rows(int64_t T) {
  const int64_t vectors = (T + kWidth - 1) / kWidth, blocks = (T + kMaxBlock - 1) / kMaxBlock;
  return (vectors + blocks - 1) / blocks * kWidth;
}

// st[r * ldst + 16 c + l] = sum_d k[r * ldk + d] qt[d * ldq + 16 c + l]: RJ keys by NQ vectors of queries.
template <int RJ, int NQ>
VITKIT_AVX512 VITKIT_INLINE void scores_tile(const float* k, int64_t ldk, const float* qt, int64_t ldq, int64_t D,
                                             float* st, int64_t ldst) {
  __m512 acc[RJ][NQ];
  for (int r = 0; r < RJ; ++r)
    for (int c = 0; c < NQ; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 qv[NQ];
    for (int c = 0; c < NQ; ++c) qv[c] = _mm512_loadu_ps(qt + d * ldq + 16 * c);
    for (int r = 0; r < RJ; ++r) {
      const __m512 kb = _mm512_set1_ps(k[r * ldk + d]);
      for (int c = 0; c < NQ; ++c) acc[r][c] = _mm512_fmadd_ps(kb, qv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RJ; ++r)
    for (int c = 0; c < NQ; ++c) _mm512_storeu_ps(st + r * ldst + 16 * c, acc[r][c]);
}

// All T keys against NQ query vectors, six keys at a time.
template <int NQ>
VITKIT_AVX512 void scores_columns(const float* k, int64_t ldk, int64_t T, const float* qt, int64_t ldq, int64_t D,
                                  float* st, int64_t ldst) {
  int64_t j = 0;
  for (; j + 6 <= T; j += 6) scores_tile<6, NQ>(k + j * ldk, ldk, qt, ldq, D, st + j * ldst, ldst);
  const float* kj = k + j * ldk;
  float* sj = st + j * ldst;
  switch (T - j) {
    case 5: scores_tile<5, NQ>(kj, ldk, qt, ldq, D, sj, ldst); break;
    case 4: scores_tile<4, NQ>(kj, ldk, qt, ldq, D, sj, ldst); break;
    case 3: scores_tile<3, NQ>(kj, ldk, qt, ldq, D, sj, ldst); break;
    case 2: scores_tile<2, NQ>(kj, ldk, qt, ldq, D, sj, ldst); break;
    case 1: scores_tile<1, NQ>(kj, ldk, qt, ldq, D, sj, ldst); break;
    default: break;
  }
}

// st <- exp(st - max) down each column of one query vector; lse and 1 / sum of each query.
VITKIT_AVX512 void softmax_columns(float* st, int64_t ldst, int64_t T, float* lse, float* inv) {
  vfloat mx = load(st);
  for (int64_t j = 1; j < T; ++j) {
    const vfloat v = load(st + j * ldst);
    mx = v > mx ? v : mx;
  }
  vfloat sum = {};
  for (int64_t j = 0; j < T; ++j) {
    const vfloat e = exp_nonpositive(load(st + j * ldst) - mx);
    store(st + j * ldst, e);
    sum += e;
  }
  for (int64_t l = 0; l < kWidth; ++l) {
    lse[l] = mx[l] + std::log(sum[l]);
    inv[l] = 1.f / sum[l];
  }
}

// A matrix of coefficients c(r, j) = p[r * ldr + j * ldj]: the same products read the softmax, or its gradient,
// as it is stored or transposed.
struct Coefficients {
  const float* p;
  int64_t ldr, ldj;
};

// o[r * ldo + 16 c + l] = f_r sum_{j < J} c(r, j) v[j * ldv + 16 c + l], f_r = scale (times inv[r] given inv): RI
// rows by DV vectors.
template <int RI, int DV>
VITKIT_AVX512 VITKIT_INLINE void values_tile(Coefficients cf, const float* v, int64_t ldv, int64_t J,
                                             const float* inv, float scale, float* o, int64_t ldo) {
  __m512 acc[RI][DV];
  for (int r = 0; r < RI; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    __m512 vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(v + j * ldv + 16 * c);
    const float* cj = cf.p + j * cf.ldj;
    for (int r = 0; r < RI; ++r) {
      const __m512 pb = _mm512_set1_ps(cj[r * cf.ldr]);
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(pb, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RI; ++r) {
    const __m512 f = _mm512_set1_ps(inv != nullptr ? scale * inv[r] : scale);
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + r * ldo + 16 * c, _mm512_mul_ps(acc[r][c], f));
  }
}

// All `rows` rows, RI at a time (as many as keep RI x DV accumulators within 24 registers).
template <int DV>
VITKIT_AVX512 void values_rows(Coefficients cf, const float* v, int64_t ldv, int64_t J, int64_t rows,
                               const float* inv, float scale, float* o, int64_t ldo) {
  constexpr int RI = DV <= 4 ? 6 : DV <= 6 ? 4 : 3;
  int64_t i = 0;
  for (; i + RI <= rows; i += RI)
    values_tile<RI, DV>({cf.p + i * cf.ldr, cf.ldr, cf.ldj}, v, ldv, J, inv ? inv + i : nullptr, scale,
                        o + i * ldo, ldo);
  const Coefficients ci{cf.p + i * cf.ldr, cf.ldr, cf.ldj};
  const float* invi = inv ? inv + i : nullptr;
  float* oi = o + i * ldo;
  switch (rows - i) {
    case 5: if constexpr (RI > 5) values_tile<5, DV>(ci, v, ldv, J, invi, scale, oi, ldo); break;
    case 4: if constexpr (RI > 4) values_tile<4, DV>(ci, v, ldv, J, invi, scale, oi, ldo); break;
    case 3: if constexpr (RI > 3) values_tile<3, DV>(ci, v, ldv, J, invi, scale, oi, ldo); break;
    case 2: values_tile<2, DV>(ci, v, ldv, J, invi, scale, oi, ldo); break;
    case 1: values_tile<1, DV>(ci, v, ldv, J, invi, scale, oi, ldo); break;
    default: break;
  }
}

// o (rows x D) = f_r sum_j c(r, j) v_j (values_tile), for D = 16 to 128.
VITKIT_AVX512 void values(Coefficients cf, const float* v, int64_t ldv, int64_t J, int64_t rows, int64_t D,
                          const float* inv, float scale, float* o, int64_t ldo) {
  switch (D / kWidth) {
    case 1: values_rows<1>(cf, v, ldv, J, rows, inv, scale, o, ldo); break;
    case 2: values_rows<2>(cf, v, ldv, J, rows, inv, scale, o, ldo); break;
    case 3: values_rows<3>(cf, v, ldv, J, rows, inv, scale, o, ldo); break;
    case 4: values_rows<4>(cf, v, ldv, J, rows, inv, scale, o, ldo); break;
    case 5: values_rows<5>(cf, v, ldv, J, rows, inv, scale, o, ldo); break;
    case 6: values_rows<6>(cf, v, ldv, J, rows, inv, scale, o, ldo); break;
    case 7: values_rows<7>(cf, v, ldv, J, rows, inv, scale, o, ldo); break;
    default: values_rows<8>(cf, v, ldv, J, rows, inv, scale, o, ldo); break;
  }
}

// st (rows x n, row stride ldst) = a bt: the rows of a (rows x D, row stride lda) against bt (D x n, row stride
// ldb, n a multiple of 16), scores_tile four vectors of columns at a time.
VITKIT_AVX512 void scores(const float* a, int64_t lda, int64_t rows, const float* bt, int64_t ldb, int64_t n,
                          int64_t D, float* st, int64_t ldst) {
  for (int64_t c = 0; c < n; c += 4 * kWidth) {
    switch (std::min<int64_t>(4, (n - c) / kWidth)) {
      case 4: scores_columns<4>(a, lda, rows, bt + c, ldb, D, st + c, ldst); break;
      case 3: scores_columns<3>(a, lda, rows, bt + c, ldb, D, st + c, ldst); break;
      case 2: scores_columns<2>(a, lda, rows, bt + c, ldb, D, st + c, ldst); break;
      default: scores_columns<1>(a, lda, rows, bt + c, ldb, D, st + c, ldst); break;
    }
  }
}

// r[l][k] <- r[k][l]: a 16 x 16 block transposed in registers, in three rounds of shuffles (pairs of floats,
// of pairs, then of 128-bit lanes).
VITKIT_AVX512 VITKIT_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4 i + c], lane L: rows 4 i to 4 i + 3 of column 4 L + c.
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// at[d * n + i] = scale * a[i * ld + d] for i < m, 0 for m <= i < n: m rows of D (a multiple of 16), transposed
// and scaled, their columns padded to n (a multiple of 16), one 16 x 16 block in registers at a time.
VITKIT_AVX512 void pack_transposed(const float* a, int64_t ld, int64_t m, int64_t n, int64_t D, float scale,
                                   float* at) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < n; i0 += kWidth) {
    const int64_t rows = std::min<int64_t>(kWidth, m - i0);
    for (int64_t d0 = 0; d0 < D; d0 += kWidth) {
      __m512 r[16];
      for (int64_t k = 0; k < 16; ++k)
        r[k] = k < rows ? _mm512_mul_ps(_mm512_loadu_ps(a + (i0 + k) * ld + d0), s) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t l = 0; l < 16; ++l) _mm512_storeu_ps(at + (d0 + l) * n + i0, r[l]);
    }
  }
}

// probs[i * T + j] = st[j * n + i] * inv[i] for the block's m queries: the softmax kept as rows, 16 x 16 at a
// time.
VITKIT_AVX512 void write_probabilities(const float* st, int64_t n, int64_t T, int64_t m, const float* inv,
                                       float* probs) {
  for (int64_t c = 0; c < m; c += kWidth) {
    const int64_t queries = std::min(kWidth, m - c);
    for (int64_t j0 = 0; j0 < T; j0 += kWidth) {
      const int64_t keys = std::min(kWidth, T - j0);
      __m512 r[16];
      for (int64_t k = 0; k < 16; ++k) r[k] = k < keys ? _mm512_loadu_ps(st + (j0 + k) * n + c) : _mm512_setzero_ps();
      transpose16(r);
      const __mmask16 mask = static_cast<__mmask16>((1u << keys) - 1);
      for (int64_t l = 0; l < queries; ++l)
        _mm512_mask_storeu_ps(probs + (c + l) * T + j0, mask, _mm512_mul_ps(r[l], _mm512_set1_ps(inv[c + l])));
    }
  }
}

// One block of m query rows of one (image, head) pair: o (m x D, row stride ldo), the block's lse and, given
// probs, its softmax rows (m x T).
VITKIT_AVX512 void attention_block_tiled(const float* q, const float* k, const float* v, int64_t ld, int64_t T,
                                         int64_t m, int64_t D, float scale, float* o, int64_t ldo, float* lse,
                                         float* probs, std::vector<float>& scratch) {
  const int64_t n = (m + kWidth - 1) / kWidth * kWidth;  // queries, padded to whole vectors
  scratch.resize(D * n + T * n + 2 * n);
  float* qt = scratch.data();
  float* st = qt + D * n;
  float* lse_block = st + T * n;
  float* inv = lse_block + n;
  pack_transposed(q, ld, m, n, D, scale, qt);
  scores(k, ld, T, qt, n, n, D, st, n);  // S^T: keys down, queries across
  for (int64_t c = 0; c < n; c += kWidth) softmax_columns(st + c, n, T, lse_block + c, inv + c);
  values({st, 1, n}, v, ld, T, m, D, inv, 1.f, o, ldo);
  std::memcpy(lse, lse_block, m * sizeof(float));
  if (probs != nullptr) write_probabilities(st, n, T, m, inv, probs);
}

// The backward of one (image, head) pair, all T queries at once (dK and dV sum over them), in the same tiles;
// p: the kept softmax (T x T) or nullptr to recompute it from q, k and lse.
VITKIT_AVX512 void attention_backward_tiled(const float* q, const float* k, const float* v, int64_t ld,
                                            const float* o, const float* go, int64_t ldo, const float* lse,
                                            const float* p, int64_t T, int64_t D, float scale, float* dq, float* dk,
                                            float* dv, std::vector<float>& scratch) {
  const int64_t n = (T + kWidth - 1) / kWidth * kWidth;  // keys, padded to whole vectors
  scratch.resize(2 * D * n + 2 * T * n);
  float* vt = scratch.data();
  float* kt = vt + D * n;
  float* grad = kt + D * n;  // dP, then dS, rows of n
  float* recomputed = grad + T * n;
  int64_t ldp = T;
  if (p == nullptr) {  // P = exp(scale q k^T - lse), rows of n (the columns past T are never read)
    pack_transposed(k, ld, T, n, D, scale, kt);
    scores(q, ld, T, kt, n, n, D, recomputed, n);
    for (int64_t i = 0; i < T; ++i) softmax_again(recomputed + i * n, T, lse[i]);
    p = recomputed;
    ldp = n;
  }
  pack_transposed(v, ld, T, n, D, 1.f, vt);
  scores(go, ldo, T, vt, n, n, D, grad, n);  // dP = dO V^T
  for (int64_t i = 0; i < T; ++i)  // dS = P * (dP - rowsum(dO * O))
    softmax_backward_row(p + i * ldp, grad + i * n, T, dot(o + i * ldo, go + i * ldo, D));
  values({p, 1, ldp}, go, ldo, T, T, D, nullptr, 1.f, dv, ld);       // dV = P^T dO
  values({grad, n, 1}, k, ld, T, T, D, nullptr, scale, dq, ld);      // dQ = scale dS K
  values({grad, 1, n}, q, ld, T, T, D, nullptr, scale, dk, ld);      // dK = scale dS^T Q
}

// Whether the tiles serve this head width on this CPU.
bool tiles_apply(int64_t D) {
  return row_isa() == RowIsa::kAvx512 && D % kWidth == 0 && D / kWidth >= 1 && D / kWidth <= 8;
}
#else
bool tiles_apply(int64_t) { return false; }
#endif

// The same block and pair on MKL's sgemm, for other head widths and CPUs (and tiles=false), with the tiled
// functions' arguments. The backward works in blocks of block_rows(T) query rows, dK and dV summed over them.
void attention_block_sgemm(const float* q, const float* k, const float* v, int64_t ld, int64_t T, int64_t m,
                           int64_t D, float scale, float* o, int64_t ldo, float* lse, float* probs,
                           std::vector<float>& scratch) {
  if (probs == nullptr) scratch.resize(m * T);
  float* scores = probs != nullptr ? probs : scratch.data();
  gemm(false, true, m, T, D, scale, q, ld, k, ld, 0.f, scores, T);
  for (int64_t i = 0; i < m; ++i) lse[i] = softmax_row(scores + i * T, T);
  gemm(false, false, m, D, T, 1.f, scores, T, v, ld, 0.f, o, ldo);
}

void attention_backward_sgemm(const float* q, const float* k, const float* v, int64_t ld, const float* o,
                              const float* go, int64_t ldo, const float* lse, const float* probs, int64_t T,
                              int64_t D, float scale, float* dq, float* dk, float* dv, std::vector<float>& scratch) {
  const int64_t bm = block_rows(T);
  scratch.resize(bm * T + T + (probs != nullptr ? 0 : bm * T));
  float* grad_scores = scratch.data();
  float* d = grad_scores + bm * T;
  float* recomputed = d + T;
  for (int64_t t = 0; t < T; ++t) d[t] = dot(o + t * ldo, go + t * ldo, D);
  for (int64_t r0 = 0; r0 < T; r0 += bm) {
    const int64_t m = std::min(bm, T - r0);
    const float accumulate = r0 == 0 ? 0.f : 1.f;
    const float* p = probs != nullptr ? probs + r0 * T : recomputed;
    if (probs == nullptr) {  // the softmax again, from the scores and the saved log-sum-exp
      gemm(false, true, m, T, D, scale, q + r0 * ld, ld, k, ld, 0.f, recomputed, T);
      for (int64_t i = 0; i < m; ++i) softmax_again(recomputed + i * T, T, lse[r0 + i]);
    }
    gemm(true, false, T, D, m, 1.f, p, T, go + r0 * ldo, ldo, accumulate, dv, ld);  // dV += P^T dO
    gemm(false, true, m, T, D, 1.f, go + r0 * ldo, ldo, v, ld, 0.f, grad_scores, T);  // dP = dO V^T
    for (int64_t i = 0; i < m; ++i) softmax_backward_row(p + i * T, grad_scores + i * T, T, d[r0 + i]);
    gemm(false, false, m, D, T, scale, grad_scores, T, k, ld, 0.f, dq + r0 * ld, ld);
    gemm(true, false, T, D, m, scale, grad_scores, T, q + r0 * ld, ld, accumulate, dk, ld);
  }
}

// The forward of one block of query rows, and the rows per block, for head width D (tiles or sgemm).
using AttentionBlock = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, float,
                                float*, int64_t, float*, float*, std::vector<float>&);

inline std::pair<AttentionBlock, int64_t> attention_kernel(int64_t T, int64_t D, bool tiles) {
#if defined(__x86_64__)
  if (tiles && tiles_apply(D)) return {attention_block_tiled, tiled_block_rows(T)};
#endif
  return {attention_block_sgemm, block_rows(T)};
}

// softmax(q k^T scale) v for the (image, head) pairs [p0, p1) (pair p: image p / heads, head p % heads) of the
// fp32 q;k;v projection `qkv` (B, T, 3C), read in place, written into `out` (B, T, C), on the calling thread
// alone, with the kernels of vitkit::attention_forward (tiles where they apply): for the int8 block, inside its
// parallel region.
inline void attention_pairs(const float* qkv, int64_t T, int64_t C, int64_t heads, int64_t p0, int64_t p1,
                            float scale, float* out) {
  const int64_t D = C / heads;
  const auto [block, bm] = attention_kernel(T, D, true);
  std::vector<float> scratch, lse(T);
  for (int64_t pair = p0; pair < p1; ++pair) {
    const int64_t b = pair / heads, h = pair % heads;
    const float* q = qkv + b * T * 3 * C + h * D;
    for (int64_t r0 = 0; r0 < T; r0 += bm) {
      const int64_t m = std::min(bm, T - r0);
      block(q + r0 * 3 * C, q + C, q + 2 * C, 3 * C, T, m, D, scale, out + (b * T + r0) * C + h * D, C,
            lse.data() + r0, nullptr, scratch);
    }
  }
}

}  // namespace

// vitkit::attention_forward / attention_backward: multi-head self-attention, softmax(q k^T * scale) v, in fp32
// on the CPU, read straight from the fused q;k;v projection (B, T, 3C) and written straight as the merged heads
// (B, T, C); the backward writes the gradient of the whole projection (B, T, 3C) at once.
//
// PyTorch's path splits the heads (views), runs its flash kernel, and in the backward stacks the three
// gradients into one tensor (a copy). Here each (image, head) pair is one task: its q, k and v are strided
// views of the projection (row stride 3C), multiplied by MKL's sgemm one block of query rows at a time, with
// the block's scores (rows x T) staying in the cache. With keep_probs the forward writes the softmax P into a
// tensor kept for the backward; without, the backward recomputes it from q, k and the saved log-sum-exp (as
// flash attention does), so memory stays linear in T:
//
//   P  = softmax(S) = exp(S - lse),  S = scale q k^T
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = scale dS K,  dK = scale dS^T Q

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector_math.h"

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

// Rows of scores, vectorised (vector_math.h).

// row <- softmax(row); returns the row's log-sum-exp.
VITKIT_CLONES float softmax_row(float* row, int64_t n) {
  const int64_t nv = n / kWidth * kWidth;
  float mx = -INFINITY;
  if (nv > 0) {
    vfloat m = load(row);
    for (int64_t i = kWidth; i < nv; i += kWidth) {
      const vfloat v = load(row + i);
      m = v > m ? v : m;
    }
    mx = max_lanes(m);
  }
  for (int64_t i = nv; i < n; ++i) mx = row[i] > mx ? row[i] : mx;
  vfloat acc = {};
  for (int64_t i = 0; i < nv; i += kWidth) {
    const vfloat e = exp_nonpositive(load(row + i) - mx);
    store(row + i, e);
    acc += e;
  }
  float sum = sum_lanes(acc);
  for (int64_t i = nv; i < n; ++i) {
    row[i] = std::exp(row[i] - mx);
    sum += row[i];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < nv; i += kWidth) store(row + i, load(row + i) * inv);
  for (int64_t i = nv; i < n; ++i) row[i] *= inv;
  return mx + std::log(sum);
}

// row <- exp(row - lse): the softmax again from the scores and the saved log-sum-exp.
VITKIT_CLONES void softmax_again(float* row, int64_t n, float lse) {
  const int64_t nv = n / kWidth * kWidth;
  for (int64_t i = 0; i < nv; i += kWidth) store(row + i, exp_nonpositive(load(row + i) - lse));
  for (int64_t i = nv; i < n; ++i) row[i] = std::exp(row[i] - lse);
}

VITKIT_CLONES float dot(const float* a, const float* b, int64_t n) {
  const int64_t nv = n / kWidth * kWidth;
  vfloat acc = {};
  for (int64_t i = 0; i < nv; i += kWidth) acc += load(a + i) * load(b + i);
  float s = sum_lanes(acc);
  for (int64_t i = nv; i < n; ++i) s += a[i] * b[i];
  return s;
}

// dp <- p * (dp - d): the softmax's backward for one row, d = rowsum(dO * O) = rowsum(P * dP).
VITKIT_CLONES void softmax_backward_row(const float* p, float* dp, int64_t n, float d) {
  const int64_t nv = n / kWidth * kWidth;
  for (int64_t i = 0; i < nv; i += kWidth) store(dp + i, load(p + i) * (load(dp + i) - d));
  for (int64_t i = nv; i < n; ++i) dp[i] = p[i] * (dp[i] - d);
}

// Query rows per block: the block's scores (and, in the backward, their gradient) stay in the cache: 2 x 128 x
// 577 floats (384 px) is 0.6 MB. Blocks of one pair are even: 197 tokens make 99 + 98 rows. (For ViT-S/16, blocks
// of 128 rows and of all 197 ran the same speed, of 64 rows ~8 % slower, forward and backward.)
constexpr int64_t kMaxBlock = 128;

int64_t block_rows(int64_t T) {
  const int64_t blocks = (T + kMaxBlock - 1) / kMaxBlock;
  return (T + blocks - 1) / blocks;
}

void check_qkv(const at::Tensor& qkv, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.device().is_cpu() && qkv.is_contiguous(),
              "vitkit attention: expected the contiguous fp32 q;k;v projection (B, T, 3C) on the CPU, got ",
              qkv.sizes(), " ", qkv.dtype(), " on ", qkv.device());
  TORCH_CHECK(heads > 0 && qkv.size(2) % (3 * heads) == 0, "vitkit attention: width ", qkv.size(2),
              " is not 3 x ", heads, " heads");
  TORCH_CHECK(qkv.size(1) > 0 && 3 * qkv.size(2) < (int64_t{1} << 31), "vitkit attention: bad size ", qkv.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(const at::Tensor& qkv, int64_t heads, double scale,
                                                                 bool keep_probs) {
  check_qkv(qkv, heads);
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, D = C / heads;
  at::Tensor out = at::empty({B, T, C}, qkv.options());
  at::Tensor lse = at::empty({B, heads, T}, qkv.options());
  at::Tensor probs = at::empty({keep_probs ? B : 0, heads, T, T}, qkv.options());
  const float* src = qkv.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  float* lse_all = lse.mutable_data_ptr<float>();
  float* probs_all = keep_probs ? probs.mutable_data_ptr<float>() : nullptr;
  const int64_t bm = block_rows(T), blocks = (T + bm - 1) / bm;
  const float alpha = static_cast<float>(scale);
  // One task per (image, head, query block): nothing is summed across blocks here.
  at::parallel_for(0, B * heads * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(keep_probs ? 0 : bm * T);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t pair = task / blocks, r0 = task % blocks * bm, m = std::min(bm, T - r0);
      const int64_t b = pair / heads, h = pair % heads;
      const float* q = src + b * T * 3 * C + h * D;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* scores = keep_probs ? probs_all + (pair * T + r0) * T : scratch.data();
      gemm(false, true, m, T, D, alpha, q + r0 * 3 * C, 3 * C, k, 3 * C, 0.f, scores, T);
      for (int64_t i = 0; i < m; ++i) lse_all[pair * T + r0 + i] = softmax_row(scores + i * T, T);
      gemm(false, false, m, D, T, 1.f, scores, T, v, 3 * C, 0.f, dst + (b * T + r0) * C + h * D, C);
    }
  });
  return {out, lse, probs};
}

at::Tensor attention_backward(const at::Tensor& grad_out_in, const at::Tensor& qkv, const at::Tensor& out,
                              const at::Tensor& lse, const at::Tensor& probs, int64_t heads, double scale) {
  check_qkv(qkv, heads);
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, D = C / heads;
  TORCH_CHECK(out.is_contiguous() && out.sizes() == at::IntArrayRef({B, T, C}) && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef({B, heads, T}),
              "vitkit attention_backward: the saved output or log-sum-exp does not match q;k;v");
  const bool kept = probs.numel() > 0;
  TORCH_CHECK(!kept || (probs.is_contiguous() && probs.sizes() == at::IntArrayRef({B, heads, T, T})),
              "vitkit attention_backward: the saved probabilities ", probs.sizes(), " do not match q;k;v");
  const at::Tensor grad_out = grad_out_in.to(at::kFloat).contiguous();
  TORCH_CHECK(grad_out.sizes() == out.sizes(), "vitkit attention_backward: gradient ", grad_out.sizes(),
              " for an output of ", out.sizes());
  at::Tensor grad_qkv = at::empty_like(qkv);
  const float* src = qkv.const_data_ptr<float>();
  const float* o_all = out.const_data_ptr<float>();
  const float* go_all = grad_out.const_data_ptr<float>();
  const float* lse_all = lse.const_data_ptr<float>();
  const float* probs_all = kept ? probs.const_data_ptr<float>() : nullptr;
  float* g_all = grad_qkv.mutable_data_ptr<float>();
  const int64_t bm = block_rows(T);
  const float alpha = static_cast<float>(scale);
  // One task per (image, head): dK and dV sum over the query blocks.
  at::parallel_for(0, B * heads, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scratch(kept ? 0 : bm * T), grad_scores(bm * T), d(T);
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t b = pair / heads, h = pair % heads;
      const float* q = src + b * T * 3 * C + h * D;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = g_all + b * T * 3 * C + h * D;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* o = o_all + b * T * C + h * D;
      const float* go = go_all + b * T * C + h * D;
      for (int64_t t = 0; t < T; ++t) d[t] = dot(o + t * C, go + t * C, D);
      for (int64_t r0 = 0; r0 < T; r0 += bm) {
        const int64_t m = std::min(bm, T - r0);
        const float accumulate = r0 == 0 ? 0.f : 1.f;
        const float* p = kept ? probs_all + (pair * T + r0) * T : scratch.data();
        if (!kept) {  // the softmax again, from the scores and the saved log-sum-exp
          gemm(false, true, m, T, D, alpha, q + r0 * 3 * C, 3 * C, k, 3 * C, 0.f, scratch.data(), T);
          for (int64_t i = 0; i < m; ++i) softmax_again(scratch.data() + i * T, T, lse_all[pair * T + r0 + i]);
        }
        gemm(true, false, T, D, m, 1.f, p, T, go + r0 * C, C, accumulate, dv, 3 * C);  // dV += P^T dO
        gemm(false, true, m, T, D, 1.f, go + r0 * C, C, v, 3 * C, 0.f, grad_scores.data(), T);    // dP = dO V^T
        for (int64_t i = 0; i < m; ++i)
          softmax_backward_row(p + i * T, grad_scores.data() + i * T, T, d[r0 + i]);
        gemm(false, false, m, D, T, alpha, grad_scores.data(), T, k, 3 * C, 0.f, dq + r0 * 3 * C, 3 * C);
        gemm(true, false, T, D, m, alpha, grad_scores.data(), T, q + r0 * 3 * C, 3 * C, accumulate, dk, 3 * C);
      }
    }
  });
  return grad_qkv;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitkit, m) {
  m.def("attention_forward(Tensor qkv, int heads, float scale, bool keep_probs) -> (Tensor, Tensor, Tensor)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor qkv, Tensor out, Tensor lse, Tensor probs, int heads, "
      "float scale) -> Tensor");
  m.impl("attention_forward", c10::DispatchKey::CPU, TORCH_FN(attention_forward));
  m.impl("attention_backward", c10::DispatchKey::CPU, TORCH_FN(attention_backward));
}

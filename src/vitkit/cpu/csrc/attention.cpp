// vitkit::attention_forward / attention_backward: multi-head self-attention, softmax(q k^T * scale) v, in fp32
// on the CPU, read straight from the fused q;k;v projection (B, T, 3C) and written straight as the merged heads
// (B, T, C); the backward writes the gradient of the whole projection (B, T, 3C) at once.
//
// PyTorch's path splits the heads (views), runs its flash kernel, and in the backward stacks the three
// gradients into one tensor (a copy). Here each (image, head) pair is one task: its q, k and v are strided
// views of the projection (row stride 3C), multiplied one block of query rows at a time, with the block's
// scores (rows x T) staying in the cache. The products run on AVX-512 register tiles where the CPU has them and
// the head width is a multiple of 16 up to 128 (all ViT presets: 64, and 80 for ViT-H); elsewhere, or with
// tiles=false, on MKL's sgemm. With keep_probs the forward writes the softmax P into a
// tensor kept for the backward; without, the backward recomputes it from q, k and the saved log-sum-exp (as
// flash attention does), so memory stays linear in T:
//
//   P  = softmax(S) = exp(S - lse),  S = scale q k^T
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = scale dS K,  dK = scale dS^T Q
//
// The kernels live in attention_kernels.h (the int8 block runs the forward's too); here, the operators.
// attention_forward_bf16 is the forward on attention_bf16.h's bf16 tiles (AVX512-BF16), for inference in bf16
// and the int8 block's "vitkit-bf16" attention.


#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "attention_bf16.h"
#include "attention_kernels.h"

namespace {

void check_qkv(const at::Tensor& qkv, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.device().is_cpu() && qkv.is_contiguous(),
              "vitkit attention: expected the contiguous fp32 q;k;v projection (B, T, 3C) on the CPU, got ",
              qkv.sizes(), " ", qkv.dtype(), " on ", qkv.device());
  TORCH_CHECK(heads > 0 && qkv.size(2) % (3 * heads) == 0, "vitkit attention: width ", qkv.size(2),
              " is not 3 x ", heads, " heads");
  TORCH_CHECK(qkv.size(1) > 0 && 3 * qkv.size(2) < (int64_t{1} << 31), "vitkit attention: bad size ", qkv.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(const at::Tensor& qkv, int64_t heads, double scale,
                                                                 bool keep_probs, bool tiles) {
  check_qkv(qkv, heads);
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, D = C / heads;
  at::Tensor out = at::empty({B, T, C}, qkv.options());
  at::Tensor lse = at::empty({B, heads, T}, qkv.options());
  at::Tensor probs = at::empty({keep_probs ? B : 0, heads, T, T}, qkv.options());
  const float* src = qkv.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  float* lse_all = lse.mutable_data_ptr<float>();
  float* probs_all = keep_probs ? probs.mutable_data_ptr<float>() : nullptr;
  const float alpha = static_cast<float>(scale);
  const auto [block, bm] = attention_kernel(T, D, tiles);
  const int64_t blocks = (T + bm - 1) / bm;
  // One task per (image, head, query block): nothing is summed across blocks here.
  at::parallel_for(0, B * heads * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t pair = task / blocks, r0 = task % blocks * bm, m = std::min(bm, T - r0);
      const int64_t b = pair / heads, h = pair % heads;
      const float* q = src + b * T * 3 * C + h * D;
      block(q + r0 * 3 * C, q + C, q + 2 * C, 3 * C, T, m, D, alpha, dst + (b * T + r0) * C + h * D, C,
            lse_all + pair * T + r0, keep_probs ? probs_all + (pair * T + r0) * T : nullptr, scratch);
    }
  });
  return {out, lse, probs};
}

at::Tensor attention_backward(const at::Tensor& grad_out_in, const at::Tensor& qkv, const at::Tensor& out,
                              const at::Tensor& lse, const at::Tensor& probs, int64_t heads, double scale,
                              bool tiles) {
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
  const float alpha = static_cast<float>(scale);
  auto pair_backward = attention_backward_sgemm;
#if defined(__x86_64__)
  if (tiles && tiles_apply(D)) pair_backward = attention_backward_tiled;
#endif
  // One task per (image, head): dK and dV sum over the queries.
  at::parallel_for(0, B * heads, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scratch;
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t b = pair / heads, h = pair % heads;
      const float* q = src + b * T * 3 * C + h * D;
      float* dq = g_all + b * T * 3 * C + h * D;
      pair_backward(q, q + C, q + 2 * C, 3 * C, o_all + b * T * C + h * D, go_all + b * T * C + h * D, C,
                    lse_all + pair * T, kept ? probs_all + pair * T * T : nullptr, T, D, alpha, dq, dq + C,
                    dq + 2 * C, scratch);
    }
  });
  return grad_qkv;
}

// softmax(q k^T scale) v of every head on the bf16 tiles (attention_bf16.h), from the projection (B, T, 3D) to
// the merged heads (B, T, D), fp32 to fp32 or bf16 to bf16 (a bf16 model's, read and written as it is: the
// same bits as the fp32 call on the projection cast to fp32, its output cast back), one task per (image, head)
// pair: inference only (no log-sum-exp).
at::Tensor attention_forward_bf16(const at::Tensor& qkv_in, int64_t heads, double scale) {
  const bool bf16 = qkv_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(heads > 0 && qkv_in.dim() == 3 && (qkv_in.scalar_type() == at::kFloat || bf16) &&
                  qkv_in.device().is_cpu() && qkv_in.size(2) % (3 * heads) == 0,
              "attention_forward_bf16: expected fp32 or bf16 (B, T, 3D) on the CPU with D divisible by ", heads,
              ", got ", qkv_in.sizes(), " ", qkv_in.dtype());
  const at::Tensor qkv = qkv_in.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(2) / 3;
  TORCH_CHECK(bf16_tiles_apply(D / heads), "attention_forward_bf16: needs AVX512-BF16 and heads of 16 to 128 ",
              "dims in multiples of 16, got ", D / heads);
  at::Tensor out = at::empty({B, T, D}, qkv.options());
  const float alpha = static_cast<float>(scale);
  at::parallel_for(0, B * heads, 1, [&](int64_t p0, int64_t p1) {
    if (bf16)
      attention_pairs_bf16(reinterpret_cast<const uint16_t*>(qkv.const_data_ptr<at::BFloat16>()), T, D, heads,
                           p0, p1, alpha, reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>()));
    else
      attention_pairs_bf16(qkv.const_data_ptr<float>(), T, D, heads, p0, p1, alpha,
                           out.mutable_data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitkit, m) {
  m.def(
      "attention_forward(Tensor qkv, int heads, float scale, bool keep_probs, bool tiles=True) -> (Tensor, Tensor, "
      "Tensor)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor qkv, Tensor out, Tensor lse, Tensor probs, int heads, "
      "float scale, bool tiles=True) -> Tensor");
  m.def("attention_tiles_apply(int head_dim) -> bool", [](int64_t head_dim) { return tiles_apply(head_dim); });
  m.def("attention_row_width() -> int", []() { return widest<RowWidth>(); });
  m.impl("attention_forward", c10::DispatchKey::CPU, TORCH_FN(attention_forward));
  m.impl("attention_backward", c10::DispatchKey::CPU, TORCH_FN(attention_backward));
  m.def("attention_forward_bf16(Tensor qkv, int heads, float scale) -> Tensor");
  m.impl("attention_forward_bf16", c10::DispatchKey::CPU, TORCH_FN(attention_forward_bf16));
  m.def("attention_bf16_tiles_apply(int head_dim) -> bool",
        [](int64_t head_dim) { return bf16_tiles_apply(head_dim); });
}

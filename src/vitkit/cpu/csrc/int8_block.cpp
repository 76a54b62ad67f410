// vitkit::int8_block: one encoder block of the int8 model as one parallel region (block_region.h).
//
// The int8 products quantise their input per call (the dynamic quantisation of fbgemm or oneDNN, whichever
// packed the weights: one scale per tensor); here the tensor is a share of the rows, so the activation scales
// are per share and the result depends, slightly, on `shares` (the caller passes the number of intra-op
// threads). The attention runs on `attention`: "vitkit" (attention_kernels.h, fp32, the register tiles where
// they apply), "vitkit-bf16" (attention_bf16.h: the same tiles in bf16, on CPUs with AVX512-BF16), "sdpa"
// (SDPA's fused kernel in fp32) or "sdpa-bf16" (the same in bf16).

#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include "attention_bf16.h"
#include "attention_kernels.h"
#include "block_region.h"

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

at::Tensor int8_block(const at::Tensor& x_in, const at::Tensor& ln1_weight, const at::Tensor& ln1_bias,
                      double ln1_eps, const at::Tensor& ln2_weight, const at::Tensor& ln2_bias, double ln2_eps,
                      const Packed& qkv, const Packed& proj, const Packed& fc1, const Packed& fc2,
                      bool reduce_range, int64_t heads, double scale, c10::string_view attention,
                      c10::string_view gelu_approximate, int64_t shares) {
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "int8_block: expected fp32 tokens (B, T, D) on the CPU, got ", x_in.sizes(), " ", x_in.dtype());
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  TORCH_CHECK(heads > 0 && D % heads == 0, "int8_block: width ", D, " is not divisible by ", heads, " heads");
  TORCH_CHECK(attention == "vitkit" || attention == "vitkit-bf16" || attention == "sdpa" || attention == "sdpa-bf16",
              "int8_block: attention must be vitkit, vitkit-bf16, sdpa or sdpa-bf16, got ", attention);
  const bool bf16_attention = attention == "sdpa-bf16", own_attention = attention == "vitkit";
  const bool own_bf16 = attention == "vitkit-bf16";
  TORCH_CHECK(!own_bf16 || bf16_tiles_apply(D / heads), "int8_block: vitkit-bf16 attention needs AVX512-BF16 and ",
              "heads of 16 to 128 dims in multiples of 16, got ", D / heads);
  const at::Tensor tokens = x.view({B * T, D});
  at::Tensor out = at::empty_like(x);
  const at::Tensor out_rows = out.view({B * T, D});
  // the q;k;v projection's output in the attention's dtype, read per head in place
  const at::Tensor qkv_rows =
      at::empty({B * T, 3 * D}, x.options().dtype(bf16_attention ? at::kBFloat16 : at::kFloat));
  const at::Tensor qkv_heads = qkv_rows.view({B, T, 3, heads, D / heads});
  const at::Tensor merged = at::empty({B, T, heads, D / heads}, x.options());
  const at::Tensor merged_rows = merged.view({B * T, D});

  vitkit::run_block(
      shares, B * T, B * heads,
      [&](int64_t r0, int64_t r1) {  // LN1 and the q;k;v product
        const at::Tensor h = at::layer_norm(tokens.slice(0, r0, r1), {D}, ln1_weight, ln1_bias, ln1_eps);
        qkv_rows.slice(0, r0, r1).copy_(qkv->apply_dynamic(h, reduce_range));
      },
      [&](int64_t p0, int64_t p1) {
        if (own_attention) {
          attention_pairs(qkv_rows.const_data_ptr<float>(), T, D, heads, p0, p1, static_cast<float>(scale),
                          merged.mutable_data_ptr<float>());
        } else if (own_bf16) {
          attention_pairs_bf16(qkv_rows.const_data_ptr<float>(), T, D, heads, p0, p1, static_cast<float>(scale),
                               merged.mutable_data_ptr<float>());
        } else {
          vitkit::attend_pairs(qkv_heads, p0, p1, scale, merged);
        }
      },
      [&](int64_t r0, int64_t r1) {  // (2): projection and residual; (3): the MLP and residual
        const at::Tensor x2 =
            proj->apply_dynamic(merged_rows.slice(0, r0, r1), reduce_range).add_(tokens.slice(0, r0, r1));
        const at::Tensor h = at::layer_norm(x2, {D}, ln2_weight, ln2_bias, ln2_eps);
        at::Tensor hidden = fc1->apply_dynamic(h, reduce_range);
        at::gelu_(hidden, gelu_approximate);
        out_rows.slice(0, r0, r1).copy_(fc2->apply_dynamic(hidden, reduce_range).add_(x2));
      });
  return out;
}

}  // namespace

TORCH_LIBRARY(vitkit, m) {
  m.def(
      "int8_block(Tensor x, Tensor ln1_weight, Tensor ln1_bias, float ln1_eps, Tensor ln2_weight, "
      "Tensor ln2_bias, float ln2_eps, __torch__.torch.classes.quantized.LinearPackedParamsBase qkv, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase proj, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase fc1, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase fc2, bool reduce_range, int heads, "
      "float scale, str attention, str gelu_approximate, int shares) -> Tensor");
  m.impl("int8_block", c10::DispatchKey::CPU, TORCH_FN(int8_block));
  // whether attention "vitkit" runs on the register tiles for this head width (else on sgemm)
  m.def("int8_block_tiles_apply(int head_dim) -> bool", [](int64_t head_dim) { return tiles_apply(head_dim); });
  // whether attention "vitkit-bf16" can run for this head width (AVX512-BF16 tiles)
  m.def("int8_block_bf16_tiles_apply(int head_dim) -> bool",
        [](int64_t head_dim) { return bf16_tiles_apply(head_dim); });
}

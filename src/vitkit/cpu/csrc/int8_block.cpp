// vitkit::int8_block: one encoder block of the int8 model as one parallel region (block_region.h).
//
// The int8 products quantise their input per call (the dynamic quantisation of fbgemm or oneDNN, whichever
// packed the weights: one scale per tensor); here the tensor is a share of the rows, so the activation scales
// are per share and the result depends, slightly, on `shares` (the caller passes the number of intra-op
// threads). The attention runs on `attention`: "vitkit" (attention_kernels.h, fp32, the register tiles where
// they apply), "vitkit-bf16" (attention_bf16.h: the same tiles in bf16, on CPUs with AVX512-BF16), "sdpa"
// (SDPA's fused kernel in fp32) or "sdpa-bf16" (the same in bf16).
//
// int8_block_vnni is the same block on vitkit's own int8 products (int8_gemm.h, CPUs with AVX512-VNNI): each
// row quantised on its own (one symmetric scale per token, so the result does not depend on the cut), the bias
// and the residual added in the product's tile, the projection's output written straight where the next step
// reads it (in bf16 for the "vitkit-bf16" attention, which reads it in place). int8_vnni_pack and
// int8_vnni_linear pack a weight for it and run one such product.

#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include "attention_bf16.h"
#include "attention_kernels.h"
#include "cpu_hold.h"
#include "block_region.h"
#include "int8_gemm.h"

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
  if (B * T == 0) return out;  // no tokens (B or T zero): nothing to compute
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

bool vnni_here() {
  __builtin_cpu_init();
  return VITKIT_AVX512_HAS("avx512f") && VITKIT_AVX512_HAS("avx512bw") &&
         VITKIT_AVX512_HAS("avx512dq") && VITKIT_AVX512_HAS("avx512vl") &&
         VITKIT_AVX512_HAS("avx512vnni");
}

// A linear layer's int8 weight (N, K) -> [its panels (padded_n(N), padded_k(K)) int8, its column sums (N)
// int32] for int8_gemm.h.
std::vector<at::Tensor> int8_vnni_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "int8_vnni_pack: expected an int8 weight (out, in) on the CPU, got ", weight.sizes(), " ",
              weight.dtype(), " on ", weight.device());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = at::empty({vitkit_i8::padded_n(N), vitkit_i8::padded_k(K)}, w.options());
  at::Tensor colsum = at::empty({N}, w.options().dtype(at::kInt));
  vitkit_i8::pack_weight(w.const_data_ptr<int8_t>(), N, K, packed.mutable_data_ptr<int8_t>(),
                         colsum.mutable_data_ptr<int32_t>());
  return {packed, colsum};
}

struct VnniWeight {  // one layer's operands, as int8_vnni_pack made them
  const int8_t* packed;
  const int32_t* colsum;
  const float* scale;
  const float* bias;  // nullptr: none
  int64_t in, out;
};

VnniWeight vnni_weight(const at::Tensor& packed, const at::Tensor& colsum, const at::Tensor& scale,
                       const at::Tensor& bias, int64_t in) {
  const int64_t out = scale.numel();
  TORCH_CHECK(vnni_here(), "int8 VNNI products need a CPU with AVX512-VNNI");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == vitkit_i8::padded_n(out) && packed.size(1) == vitkit_i8::padded_k(in),
              "int8 VNNI product: the packed weight ", packed.sizes(), " does not match ", out, " outputs x ", in,
              " inputs (int8_vnni_pack)");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == out &&
                  scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1,
              "int8 VNNI product: the column sums (", colsum.numel(), ", int32) and scales (", out,
              ", fp32) must be as many, contiguous (int8_vnni_pack)");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == out && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "int8 VNNI product: the bias has ", bias.numel(), " values for ", out, " outputs");
  return {packed.const_data_ptr<int8_t>(), colsum.const_data_ptr<int32_t>(), scale.const_data_ptr<float>(),
          bias.numel() ? bias.const_data_ptr<float>() : nullptr, in, out};
}

// The products of rows [r0, r1), already quantised into q (stride ldq) with scales sa (both indexed by row
// number), through layer w into c (stride ldc), with epilogue E (a residual from res, stride ldr).
template <vitkit_i8::Epilogue E, typename Out = float>
void vnni_product(const VnniWeight& w, const uint8_t* q, int64_t ldq, const float* sa, int64_t r0, int64_t r1,
                  Out* c, int64_t ldc, const float* res = nullptr, int64_t ldr = 0) {
  vitkit_i8::gemm<E, Out>(q + r0 * ldq, ldq, r1 - r0, vitkit_i8::padded_k(w.in), sa + r0, w.packed, w.colsum, w.scale,
                     w.bias, w.out, c + r0 * ldc, ldc, res ? res + r0 * ldr : nullptr, ldr);
}

// y = x W^T + b for x (..., K) fp32, on the packed int8 weight with per-output scales `scale` (N,).
at::Tensor int8_vnni_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& colsum,
                            const at::Tensor& scale, const at::Tensor& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "int8_vnni_linear: expected fp32 rows on the CPU, got ", x_in.sizes(), " ", x_in.dtype());
  const int64_t K = x_in.size(-1);
  const VnniWeight w = vnni_weight(packed, colsum, scale, bias, K);
  const at::Tensor x = x_in.contiguous().view({-1, K});
  const int64_t M = x.size(0), ldq = vitkit_i8::padded_k(K);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = w.out;
  at::Tensor y = at::empty(shape, x.options());
  at::Tensor q = at::empty({M, ldq}, x.options().dtype(at::kByte));
  at::Tensor sa = at::empty({M}, x.options());
  const float* xp = x.const_data_ptr<float>();
  uint8_t* qp = q.mutable_data_ptr<uint8_t>();
  float *sp = sa.mutable_data_ptr<float>(), *yp = y.mutable_data_ptr<float>();
  const int64_t tiles = (M + vitkit_i8::MR - 1) / vitkit_i8::MR, panels = vitkit_i8::padded_n(w.out) / vitkit_i8::NR;
  if (tiles >= at::get_num_threads()) {  // the rows shared among the threads
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const int64_t r0 = t0 * vitkit_i8::MR, r1 = std::min(M, t1 * vitkit_i8::MR);
      vitkit_i8::quantize_rows(xp + r0 * K, K, r1 - r0, K, qp + r0 * ldq, ldq, sp + r0);
      vnni_product<vitkit_i8::Epilogue::kStore>(w, qp, ldq, sp, r0, r1, yp, w.out);
    });
  } else {  // a few rows (the last block's class tokens): the columns shared instead
    vitkit_i8::quantize_rows(xp, K, M, K, qp, ldq, sp);
    const int64_t Kp = vitkit_i8::padded_k(K);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      const int64_t n0 = p0 * vitkit_i8::NR, n1 = std::min(w.out, p1 * vitkit_i8::NR);
      vitkit_i8::gemm<vitkit_i8::Epilogue::kStore>(qp, ldq, M, Kp, sp, w.packed + n0 * Kp, w.colsum + n0,
                                                   w.scale + n0, w.bias ? w.bias + n0 : nullptr, n1 - n0, yp + n0,
                                                   w.out, nullptr, 0);
    });
  }
  return y;
}

at::Tensor int8_block_vnni(const at::Tensor& x_in, const at::Tensor& ln1_weight, const at::Tensor& ln1_bias,
                           double ln1_eps, const at::Tensor& ln2_weight, const at::Tensor& ln2_bias, double ln2_eps,
                           at::TensorList packed, at::TensorList colsum, at::TensorList scales,
                           at::TensorList biases, int64_t heads, double scale, c10::string_view attention,
                           c10::string_view gelu_approximate, int64_t shares) {
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "int8_block_vnni: expected fp32 tokens (B, T, D) on the CPU, got ", x_in.sizes(), " ", x_in.dtype());
  TORCH_CHECK(packed.size() == 4 && colsum.size() == 4 && scales.size() == 4 && biases.size() == 4,
              "int8_block_vnni: expected the q;k;v, projection, fc1 and fc2 layers' operands, four of each");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), rows = B * T;
  TORCH_CHECK(heads > 0 && D % heads == 0, "int8_block_vnni: width ", D, " is not divisible by ", heads, " heads");
  TORCH_CHECK(attention == "vitkit" || attention == "vitkit-bf16" || attention == "sdpa" || attention == "sdpa-bf16",
              "int8_block_vnni: attention must be vitkit, vitkit-bf16, sdpa or sdpa-bf16, got ", attention);
  TORCH_CHECK(attention != "vitkit-bf16" || bf16_tiles_apply(D / heads), "int8_block_vnni: vitkit-bf16 attention ",
              "needs AVX512-BF16 and heads of 16 to 128 dims in multiples of 16, got ", D / heads);
  const int64_t hidden = scales[2].numel();
  const VnniWeight qkv = vnni_weight(packed[0], colsum[0], scales[0], biases[0], D);
  const VnniWeight proj = vnni_weight(packed[1], colsum[1], scales[1], biases[1], D);
  const VnniWeight fc1 = vnni_weight(packed[2], colsum[2], scales[2], biases[2], D);
  const VnniWeight fc2 = vnni_weight(packed[3], colsum[3], scales[3], biases[3], hidden);
  TORCH_CHECK(qkv.out == 3 * D && proj.out == D && fc2.out == D,
              "int8_block_vnni: layer widths ", qkv.out, ", ", proj.out, ", ", fc2.out, " do not fit width ", D);
  TORCH_CHECK(gelu_approximate == "none" || gelu_approximate == "tanh",
              "int8_block_vnni: gelu_approximate must be none or tanh, got ", gelu_approximate);
  for (const at::Tensor& t : {ln1_weight, ln1_bias, ln2_weight, ln2_bias})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == D,
                "int8_block_vnni: the LayerNorms' weights and biases must be ", D, " contiguous fp32 values");
  const bool bf16_heads = attention == "sdpa-bf16", tanh = gelu_approximate == "tanh";
  // vitkit's bf16 tiles read the projection in bf16, written so by the product (half the bytes, k read in
  // place); SDPA's bf16 kernel reads a copy
  const bool own_bf16 = attention == "vitkit-bf16";
  const at::Tensor tokens = x.view({rows, D});
  at::Tensor out = at::empty_like(x);
  if (rows == 0) return out;  // no tokens (B or T zero): nothing to compute
  const at::Tensor qkv_rows = at::empty({rows, 3 * D}, x.options().dtype(own_bf16 ? at::kBFloat16 : at::kFloat));
  const at::Tensor qkv_bf16 = bf16_heads ? at::empty({rows, 3 * D}, x.options().dtype(at::kBFloat16)) : at::Tensor();
  const at::Tensor merged = at::empty({B, T, heads, D / heads}, x.options());
  const at::Tensor hidden_rows = at::empty({rows, hidden}, x.options());
  const int64_t ldq = std::max(vitkit_i8::padded_k(D), vitkit_i8::padded_k(hidden));
  const at::Tensor q = at::empty({rows, ldq}, x.options().dtype(at::kByte));
  const at::Tensor sa = at::empty({rows}, x.options());
  uint8_t* qp = q.mutable_data_ptr<uint8_t>();
  float* sp = sa.mutable_data_ptr<float>();
  float* outp = out.mutable_data_ptr<float>();
  float* qkvp = own_bf16 ? nullptr : qkv_rows.mutable_data_ptr<float>();
  uint16_t* qkvb = own_bf16 ? reinterpret_cast<uint16_t*>(qkv_rows.mutable_data_ptr<at::BFloat16>()) : nullptr;
  float *mp = merged.mutable_data_ptr<float>(), *hp = hidden_rows.mutable_data_ptr<float>();
  const float* xp = tokens.const_data_ptr<float>();
  const float *n1w = ln1_weight.const_data_ptr<float>(), *n1b = ln1_bias.const_data_ptr<float>();
  const float *n2w = ln2_weight.const_data_ptr<float>(), *n2b = ln2_bias.const_data_ptr<float>();
  using vitkit_i8::Epilogue;
  // The MLP walks its rows in blocks of kRows: a block's hidden activations (kRows x hidden fp32, 288 KiB for
  // ViT-S/16) are quantised while they are in L2, where the whole share's would have gone out to memory.
  constexpr int64_t kRows = 48;

  vitkit::run_block(
      shares, rows, B * heads,
      [&](int64_t r0, int64_t r1) {  // LN1 and the q;k;v product
        std::vector<float> row(D);
        vitkit_i8::layer_norm_quantize_rows(xp + r0 * D, D, r1 - r0, D, n1w, n1b, static_cast<float>(ln1_eps),
                                            row.data(), qp + r0 * ldq, ldq, sp + r0);
        if (own_bf16) {
          vnni_product<Epilogue::kStore>(qkv, qp, ldq, sp, r0, r1, qkvb, 3 * D);
        } else {
          vnni_product<Epilogue::kStore>(qkv, qp, ldq, sp, r0, r1, qkvp, 3 * D);
        }
        if (bf16_heads) qkv_bf16.slice(0, r0, r1).copy_(qkv_rows.slice(0, r0, r1));
      },
      [&](int64_t p0, int64_t p1) {
        if (attention == "vitkit") {
          attention_pairs(qkvp, T, D, heads, p0, p1, static_cast<float>(scale), mp);
        } else if (own_bf16) {
          attention_pairs_bf16(static_cast<const uint16_t*>(qkvb), T, D, heads, p0, p1, static_cast<float>(scale),
                               mp);
        } else {
          vitkit::attend_pairs((bf16_heads ? qkv_bf16 : qkv_rows).view({B, T, 3, heads, D / heads}), p0, p1, scale,
                               merged);
        }
      },
      [&](int64_t r0, int64_t r1) {  // (2): projection and residual; (3): the MLP and residual
        std::vector<float> row(D);
        vitkit::row_blocks(r0, r1, vitkit_i8::MR, kRows, [&](int64_t b0, int64_t b1) {
          vitkit_i8::quantize_rows(mp + b0 * D, D, b1 - b0, D, qp + b0 * ldq, ldq, sp + b0);
          vnni_product<Epilogue::kResidual>(proj, qp, ldq, sp, b0, b1, outp, D, xp, D);
          vitkit_i8::layer_norm_quantize_rows(outp + b0 * D, D, b1 - b0, D, n2w, n2b, static_cast<float>(ln2_eps),
                                              row.data(), qp + b0 * ldq, ldq, sp + b0);
          if (tanh) {
            vnni_product<Epilogue::kGeluTanh>(fc1, qp, ldq, sp, b0, b1, hp, hidden);
          } else {
            vnni_product<Epilogue::kGelu>(fc1, qp, ldq, sp, b0, b1, hp, hidden);
          }
          vitkit_i8::quantize_rows(hp + b0 * hidden, hidden, b1 - b0, hidden, qp + b0 * ldq, ldq, sp + b0);
          vnni_product<Epilogue::kResidual>(fc2, qp, ldq, sp, b0, b1, outp, D, outp, D);
        });
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
  m.def(
      "int8_block_vnni(Tensor x, Tensor ln1_weight, Tensor ln1_bias, float ln1_eps, Tensor ln2_weight, "
      "Tensor ln2_bias, float ln2_eps, Tensor[] packed, Tensor[] colsum, Tensor[] scales, Tensor[] biases, "
      "int heads, float scale, str attention, str gelu_approximate, int shares) -> Tensor");
  m.impl("int8_block_vnni", c10::DispatchKey::CPU, TORCH_FN(int8_block_vnni));
  m.def("int8_vnni_pack(Tensor weight) -> Tensor[]", &int8_vnni_pack);
  m.def("int8_vnni_linear(Tensor x, Tensor packed, Tensor colsum, Tensor scale, Tensor bias) -> Tensor");
  m.impl("int8_vnni_linear", c10::DispatchKey::CPU, TORCH_FN(int8_vnni_linear));
  // whether this CPU runs the int8 VNNI products (AVX512-VNNI)
  m.def("int8_vnni_here() -> bool", []() { return vnni_here(); });
  // whether attention "vitkit" runs on the register tiles for this head width (else on sgemm)
  m.def("int8_block_tiles_apply(int head_dim) -> bool", [](int64_t head_dim) { return tiles_apply(head_dim); });
  // whether attention "vitkit-bf16" can run for this head width (AVX512-BF16 tiles)
  m.def("int8_block_bf16_tiles_apply(int head_dim) -> bool",
        [](int64_t head_dim) { return bf16_tiles_apply(head_dim); });
}

// vitkit::fp32_block: one encoder block of the fp32 model (eq. 2 and 3) as one parallel region (block_region.h),
// on vitkit's fp32 products for AVX-512 CPUs (fp32_gemm.h).
//
// Run operator by operator, a block is some fifteen parallel regions (each LayerNorm, product, attention, add),
// and at each the threads meet; at batch 1 the products are short (ViT-S/16: 0.3-1.2 ms each on 2 cores) and
// the meetings, with the passes over memory between the operators, cost several per cent of the call. Here
// each thread takes its share of the rows through LayerNorm 1 and the q;k;v product (its output written where
// the attention reads it), the (image, head) pairs through the attention (attention_kernels.h's tiles), and
// its rows again through the projection with the residual added in the tile, LayerNorm 2, fc1 with GELU in the
// tile and fc2 with the residual, in blocks of ~48 rows so that the hidden activations stay in L2. Every
// output is computed by one thread in one order, whatever `shares` is: the result does not depend on it.
// fp32_block_pack packs a weight for it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "attention_kernels.h"
#include "block_region.h"
#include "fp32_gemm.h"

namespace {

bool fp32_block_here() {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512;
}

// W (N, K) fp32, N a multiple of 64 -> panels (N / 64, K, 64) for fp32_block.
at::Tensor fp32_block_pack(const at::Tensor& weight) {
  TORCH_CHECK(fp32_block_here(), "fp32_block_pack: needs a CPU with AVX-512");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu() &&
                  weight.size(0) > 0 && weight.size(0) % vitkit_f32::NR == 0 && weight.size(1) > 0,
              "fp32_block_pack: expected an fp32 weight (out, in) on the CPU with out a multiple of ",
              vitkit_f32::NR, ", got ", weight.sizes(), " ", weight.dtype(), " on ", weight.device());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = at::empty({N / vitkit_f32::NR, K, vitkit_f32::NR}, w.options());
  vitkit_f32::pack_weight(w.const_data_ptr<float>(), N, K, packed.mutable_data_ptr<float>());
  return packed;
}

struct Layer {  // one layer's operands, as fp32_block_pack made them
  const float* packed;
  const float* bias;  // nullptr: none
  int64_t in, out;
};

Layer layer(const at::Tensor& packed, const at::Tensor& bias, int64_t in, const char* name) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(1) == in && packed.size(2) == vitkit_f32::NR,
              "fp32_block: the ", name, " weight ", packed.sizes(), " is not a packed weight of ", in,
              " inputs (fp32_block_pack)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.const_data_ptr()) % 64 == 0, "fp32_block: the ", name,
              " weight is not 64-byte aligned (fp32_block_pack's are)");
  const int64_t out = packed.size(0) * vitkit_f32::NR;
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == out && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "fp32_block: the ", name, " bias has ", bias.numel(), " values for ", out, " outputs");
  return {packed.const_data_ptr<float>(), bias.numel() ? bias.const_data_ptr<float>() : nullptr, in, out};
}

// The product of rows [r0, r1) of x (stride ldx) through layer w into c (stride ldc), with epilogue E (the
// residual from res, stride ldr).
template <vitkit_f32::Epilogue E>
void product(const Layer& w, const float* x, int64_t ldx, int64_t r0, int64_t r1, float* c, int64_t ldc,
             const float* res = nullptr, int64_t ldr = 0) {
  vitkit_f32::gemm<E>(x + r0 * ldx, ldx, r1 - r0, w.in, w.packed, w.bias, w.out, c + r0 * ldc, ldc,
                      res ? res + r0 * ldr : nullptr, ldr);
}

at::Tensor fp32_block(const at::Tensor& x_in, const at::Tensor& ln1_weight, const at::Tensor& ln1_bias,
                      double ln1_eps, const at::Tensor& ln2_weight, const at::Tensor& ln2_bias, double ln2_eps,
                      at::TensorList packed, at::TensorList biases, int64_t heads, double scale,
                      c10::string_view gelu_approximate, int64_t shares) {
  TORCH_CHECK(fp32_block_here(), "fp32_block: needs a CPU with AVX-512");
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "fp32_block: expected fp32 tokens (B, T, D) on the CPU, got ", x_in.sizes(), " ", x_in.dtype());
  TORCH_CHECK(packed.size() == 4 && biases.size() == 4,
              "fp32_block: expected the q;k;v, projection, fc1 and fc2 layers' weights and biases, four of each");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), rows = B * T;
  TORCH_CHECK(heads > 0 && D % heads == 0, "fp32_block: width ", D, " is not divisible by ", heads, " heads");
  TORCH_CHECK(gelu_approximate == "none" || gelu_approximate == "tanh",
              "fp32_block: gelu_approximate must be none or tanh, got ", gelu_approximate);
  const Layer qkv = layer(packed[0], biases[0], D, "q;k;v"), proj = layer(packed[1], biases[1], D, "projection");
  const Layer fc1 = layer(packed[2], biases[2], D, "fc1");
  const Layer fc2 = layer(packed[3], biases[3], fc1.out, "fc2");
  TORCH_CHECK(qkv.out == 3 * D && proj.out == D && fc2.out == D, "fp32_block: layer widths ", qkv.out, ", ",
              proj.out, ", ", fc2.out, " do not fit width ", D);
  for (const at::Tensor& t : {ln1_weight, ln1_bias, ln2_weight, ln2_bias})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == D,
                "fp32_block: the LayerNorms' weights and biases must be ", D, " contiguous fp32 values");
  const int64_t hidden = fc1.out;
  at::Tensor out = at::empty_like(x);
  if (rows == 0) return out;  // no tokens (B or T zero): nothing to compute
  const at::Tensor normed = at::empty({rows, D}, x.options());  // LN1's, then LN2's output
  const at::Tensor qkv_rows = at::empty({rows, 3 * D}, x.options());
  const at::Tensor merged = at::empty({rows, D}, x.options());
  const at::Tensor hidden_rows = at::empty({rows, hidden}, x.options());
  const float* xp = x.const_data_ptr<float>();
  float *outp = out.mutable_data_ptr<float>(), *np = normed.mutable_data_ptr<float>();
  float *qkvp = qkv_rows.mutable_data_ptr<float>(), *mp = merged.mutable_data_ptr<float>();
  float* hp = hidden_rows.mutable_data_ptr<float>();
  const float *n1w = ln1_weight.const_data_ptr<float>(), *n1b = ln1_bias.const_data_ptr<float>();
  const float *n2w = ln2_weight.const_data_ptr<float>(), *n2b = ln2_bias.const_data_ptr<float>();
  const bool tanh = gelu_approximate == "tanh";
  using vitkit_f32::Epilogue;
  constexpr int64_t kRows = 48;  // the MLP's rows a block: 48 x hidden fp32 (288 KiB for ViT-S/16) in L2

  vitkit::run_block(
      shares, rows, B * heads,
      [&](int64_t r0, int64_t r1) {  // LN1 and the q;k;v product
        vitkit_avx512::layer_norm_rows(xp + r0 * D, D, r1 - r0, D, n1w, n1b, static_cast<float>(ln1_eps),
                                       np + r0 * D, D);
        product<Epilogue::kStore>(qkv, np, D, r0, r1, qkvp, 3 * D);
      },
      [&](int64_t p0, int64_t p1) { attention_pairs(qkvp, T, D, heads, p0, p1, static_cast<float>(scale), mp); },
      [&](int64_t r0, int64_t r1) {  // (2): projection and residual; (3): the MLP and residual
        vitkit::row_blocks(r0, r1, vitkit_f32::MR, kRows, [&](int64_t b0, int64_t b1) {
          product<Epilogue::kResidual>(proj, mp, D, b0, b1, outp, D, xp, D);
          vitkit_avx512::layer_norm_rows(outp + b0 * D, D, b1 - b0, D, n2w, n2b, static_cast<float>(ln2_eps),
                                         np + b0 * D, D);
          if (tanh) {
            product<Epilogue::kGeluTanh>(fc1, np, D, b0, b1, hp, hidden);
          } else {
            product<Epilogue::kGelu>(fc1, np, D, b0, b1, hp, hidden);
          }
          product<Epilogue::kResidual>(fc2, hp, hidden, b0, b1, outp, D, outp, D);
        });
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitkit, m) {
  m.def(
      "fp32_block(Tensor x, Tensor ln1_weight, Tensor ln1_bias, float ln1_eps, Tensor ln2_weight, "
      "Tensor ln2_bias, float ln2_eps, Tensor[] packed, Tensor[] biases, int heads, float scale, "
      "str gelu_approximate, int shares) -> Tensor");
  m.impl("fp32_block", c10::DispatchKey::CPU, TORCH_FN(fp32_block));
  m.def("fp32_block_pack(Tensor weight) -> Tensor");
  m.impl("fp32_block_pack", c10::DispatchKey::CPU, TORCH_FN(fp32_block_pack));
  // whether this CPU runs the fp32 block (AVX-512)
  m.def("fp32_block_here() -> bool", []() { return fp32_block_here(); });
}

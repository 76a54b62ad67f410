// vitkit::bf16_block: one encoder block of the bf16 model (eq. 2 and 3) as one parallel region (block_region.h),
// on vitkit's bf16 products for CPUs with AVX512-BF16 (bf16_gemm.h).
//
// fp32_block.cpp's structure in bf16: each thread takes its share of the rows through LayerNorm 1
// (layer_norm_bf16.h, the kernel of the bf16 model's LayerNorms) and the q;k;v product, the (image, head) pairs
// through the attention (attention_bf16.h, reading the bf16 projection in place), and its rows again through
// the projection with the residual added in the tile, LayerNorm 2, fc1 with GELU in the tile and fc2 with the
// residual, in blocks of ~48 rows so that the hidden activations stay in L2. Every value the layers' fused
// products round to bf16 is rounded here too (each product's output with its bias, residual and GELU, each
// LayerNorm's output), so the block computes what the bf16 model's layers do, up to the order of the fp32
// sums. Every
// output is computed by one thread in one order, whatever `shares` is: the result does not depend on it.
// bf16_block_pack packs a weight for it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "attention_bf16.h"
#include "bf16_gemm.h"
#include "block_region.h"
#include "layer_norm_bf16.h"

namespace {

bool bf16_block_here() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return ok;
}

uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// W (N, K) bf16, N a multiple of 64 and K even -> panels (N / 64, K / 2, 64, 2) for bf16_block.
at::Tensor bf16_block_pack(const at::Tensor& weight) {
  TORCH_CHECK(bf16_block_here(), "bf16_block_pack: needs a CPU with AVX512-BF16");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu() &&
                  weight.size(0) > 0 && weight.size(0) % vitkit_bf16::NR == 0 && weight.size(1) > 0 &&
                  weight.size(1) % 2 == 0,
              "bf16_block_pack: expected a bf16 weight (out, in) on the CPU with out a multiple of ",
              vitkit_bf16::NR, " and in even, got ", weight.sizes(), " ", weight.dtype(), " on ", weight.device());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = at::empty({N / vitkit_bf16::NR, K / 2, vitkit_bf16::NR, 2}, w.options());
  vitkit_bf16::pack_weight(bits(w), N, K, bits(packed));
  return packed;
}

struct Layer {  // one layer's operands, as bf16_block_pack made them
  const uint16_t* packed;
  const float* bias;  // nullptr: none
  int64_t in, out;
};

Layer layer(const at::Tensor& packed, const at::Tensor& bias, int64_t in, const char* name) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) * 2 == in && packed.size(2) == vitkit_bf16::NR && packed.size(3) == 2,
              "bf16_block: the ", name, " weight ", packed.sizes(), " is not a packed weight of ", in,
              " inputs (bf16_block_pack)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.const_data_ptr()) % 64 == 0, "bf16_block: the ", name,
              " weight is not 64-byte aligned (bf16_block_pack's are)");
  const int64_t out = packed.size(0) * vitkit_bf16::NR;
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == out && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bf16_block: the ", name, " bias has ", bias.numel(), " values for ", out, " outputs (fp32 expected)");
  return {bits(packed), bias.numel() ? bias.const_data_ptr<float>() : nullptr, in, out};
}

// The product of rows [r0, r1) of x (stride ldx) through layer w into c (stride ldc), with epilogue E (the
// residual from res, stride ldr).
template <vitkit_bf16::Epilogue E>
void product(const Layer& w, const uint16_t* x, int64_t ldx, int64_t r0, int64_t r1, uint16_t* c, int64_t ldc,
             const uint16_t* res = nullptr, int64_t ldr = 0) {
  vitkit_bf16::gemm<E>(x + r0 * ldx, ldx, r1 - r0, w.in, w.packed, w.bias, w.out, c + r0 * ldc, ldc,
                       res ? res + r0 * ldr : nullptr, ldr);
}

at::Tensor bf16_block(const at::Tensor& x_in, const at::Tensor& ln1_weight, const at::Tensor& ln1_bias,
                      double ln1_eps, const at::Tensor& ln2_weight, const at::Tensor& ln2_bias, double ln2_eps,
                      at::TensorList packed, at::TensorList biases, int64_t heads, double scale,
                      c10::string_view gelu_approximate, int64_t shares) {
  TORCH_CHECK(bf16_block_here(), "bf16_block: needs a CPU with AVX512-BF16");
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "bf16_block: expected bf16 tokens (B, T, D) on the CPU, got ", x_in.sizes(), " ", x_in.dtype());
  TORCH_CHECK(packed.size() == 4 && biases.size() == 4,
              "bf16_block: expected the q;k;v, projection, fc1 and fc2 layers' weights and biases, four of each");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), rows = B * T;
  TORCH_CHECK(heads > 0 && D % heads == 0 && bf16_tiles_apply(D / heads), "bf16_block: width ", D, " in ", heads,
              " heads: the attention's bf16 tiles need heads of 16 to 128 dims in multiples of 16");
  TORCH_CHECK(gelu_approximate == "none" || gelu_approximate == "tanh",
              "bf16_block: gelu_approximate must be none or tanh, got ", gelu_approximate);
  const Layer qkv = layer(packed[0], biases[0], D, "q;k;v"), proj = layer(packed[1], biases[1], D, "projection");
  const Layer fc1 = layer(packed[2], biases[2], D, "fc1");
  const Layer fc2 = layer(packed[3], biases[3], fc1.out, "fc2");
  TORCH_CHECK(qkv.out == 3 * D && proj.out == D && fc2.out == D, "bf16_block: layer widths ", qkv.out, ", ",
              proj.out, ", ", fc2.out, " do not fit width ", D);
  for (const at::Tensor& t : {ln1_weight, ln1_bias, ln2_weight, ln2_bias})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == D,
                "bf16_block: the LayerNorms' weights and biases must be ", D, " contiguous fp32 values");
  const int64_t hidden = fc1.out;
  at::Tensor out = at::empty_like(x);
  if (rows == 0) return out;  // no tokens (B or T zero): nothing to compute
  const at::Tensor normed = at::empty({rows, D}, x.options());  // LN1's, then LN2's output
  const at::Tensor qkv_rows = at::empty({rows, 3 * D}, x.options());
  const at::Tensor merged = at::empty({rows, D}, x.options());
  const at::Tensor hidden_rows = at::empty({rows, hidden}, x.options());
  const uint16_t* xp = bits(x);
  uint16_t *outp = bits(out), *np = bits(normed), *qkvp = bits(qkv_rows), *mp = bits(merged);
  uint16_t* hp = bits(hidden_rows);
  const float *n1w = ln1_weight.const_data_ptr<float>(), *n1b = ln1_bias.const_data_ptr<float>();
  const float *n2w = ln2_weight.const_data_ptr<float>(), *n2b = ln2_bias.const_data_ptr<float>();
  const float eps1 = static_cast<float>(ln1_eps), eps2 = static_cast<float>(ln2_eps);
  const bool tanh = gelu_approximate == "tanh";
  using vitkit_bf16::Epilogue;
  using vitkit_bf16_norm::layer_norm_rows;
  constexpr int64_t kRows = 48;  // the MLP's rows a block: 48 x hidden bf16 (144 KiB for ViT-S/16) in L2

  vitkit::run_block(
      shares, rows, B * heads,
      [&](int64_t r0, int64_t r1) {  // LN1 and the q;k;v product
        std::vector<float> row((D + 15) / 16 * 16);
        layer_norm_rows(xp + r0 * D, r1 - r0, D, n1w, n1b, eps1, row.data(), np + r0 * D);
        product<Epilogue::kStore>(qkv, np, D, r0, r1, qkvp, 3 * D);
      },
      [&](int64_t p0, int64_t p1) {
        attention_pairs_bf16(static_cast<const uint16_t*>(qkvp), T, D, heads, p0, p1, static_cast<float>(scale),
                             mp);
      },
      [&](int64_t r0, int64_t r1) {  // (2): projection and residual; (3): the MLP and residual
        std::vector<float> row((D + 15) / 16 * 16);
        vitkit::row_blocks(r0, r1, vitkit_bf16::MR, kRows, [&](int64_t b0, int64_t b1) {
          product<Epilogue::kResidual>(proj, mp, D, b0, b1, outp, D, xp, D);
          layer_norm_rows(outp + b0 * D, b1 - b0, D, n2w, n2b, eps2, row.data(), np + b0 * D);
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
      "bf16_block(Tensor x, Tensor ln1_weight, Tensor ln1_bias, float ln1_eps, Tensor ln2_weight, "
      "Tensor ln2_bias, float ln2_eps, Tensor[] packed, Tensor[] biases, int heads, float scale, "
      "str gelu_approximate, int shares) -> Tensor");
  m.impl("bf16_block", c10::DispatchKey::CPU, TORCH_FN(bf16_block));
  m.def("bf16_block_pack(Tensor weight) -> Tensor");
  m.impl("bf16_block_pack", c10::DispatchKey::CPU, TORCH_FN(bf16_block_pack));
  // whether this CPU runs the bf16 block (AVX512-BF16)
  m.def("bf16_block_here() -> bool", []() { return bf16_block_here(); });
}

// The encoder block operator (eq. 2 and 3) of fp32_block.cpp and bf16_block.cpp, over a policy K that names
// the element type of its activations and packed weights and supplies its kernels.
//
// Each thread takes its share of the rows through LayerNorm 1 and the q;k;v product (its output written where
// the attention reads it), the (image, head) pairs through the attention, and its rows again through the
// projection with the residual added in the tile, LayerNorm 2, fc1 with GELU in the tile and fc2 with the
// residual, in blocks of ~48 rows (K::mlp_rows) so that the hidden activations stay in L2 (block_region.h's
// run_block: two meeting points a block). Every output is computed by one thread in one order, whatever
// `shares` is.
//
// K provides:
//   using T                                  the activations' and packed weights' element type
//   name, dtype, dtype_name, cpu             "fp32_block", at::kFloat, "fp32", "a CPU with AVX2 and FMA"
//   MR, NR                                   the products' tile rows and panel columns
//   mlp_rows                                 the rows of a block of the MLP (see kRows below)
//   here()                                   whether this CPU runs it
//   heads_apply(head_dim) / heads_message    whether the attention takes heads of this width, and else why
//   packed_fits(packed, in) / packed_layout  whether `packed` is a packed weight of `in` inputs, and its layout
//   data(tensor)                             the tensor's elements as const T*, or T* (mutable)
//   layer_norm(x, rows, D, w, b, eps, y)     LayerNorm of rows of D (contiguous) with fp32 gain and bias
//   attention(qkv, tokens, D, heads, p0, p1, scale, out)   the (image, head) pairs [p0, p1)
//   gemm<E>(x, lda, M, K, packed, bias, N, c, ldc, res, ldr)   c = x W^T + b with epilogue E
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <cstdint>

#include "avx512_math.h"
#include "block_region.h"

namespace vitkit {

template <typename T>
struct PackedLayer {  // one layer's operands, as the operator's pack function made them
  const T* packed;
  const float* bias;  // nullptr: none
  int64_t in, out;
};

template <class K>
PackedLayer<typename K::T> packed_layer(const at::Tensor& packed, const at::Tensor& bias, int64_t in,
                                        const char* name) {
  TORCH_CHECK(packed.scalar_type() == K::dtype && packed.is_contiguous() && K::packed_fits(packed, in), K::name,
              ": the ", name, " weight ", packed.sizes(), " is not a packed weight of ", in, " inputs (",
              K::packed_layout, ")");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.const_data_ptr()) % 64 == 0, K::name, ": the ", name,
              " weight is not 64-byte aligned (", K::packed_layout, "'s are)");
  const int64_t out = packed.size(0) * K::NR;
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == out && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              K::name, ": the ", name, " bias has ", bias.numel(), " values for ", out, " outputs (fp32 expected)");
  return {K::data(packed), bias.numel() ? bias.const_data_ptr<float>() : nullptr, in, out};
}

// The product of rows [r0, r1) of x (stride ldx) through layer w into c (stride ldc), with epilogue E (the
// residual from res, stride ldr).
template <class K, vitkit_avx512::Epilogue E, typename T>
void layer_product(const PackedLayer<T>& w, const T* x, int64_t ldx, int64_t r0, int64_t r1, T* c, int64_t ldc,
                   const T* res = nullptr, int64_t ldr = 0) {
  K::template gemm<E>(x + r0 * ldx, ldx, r1 - r0, w.in, w.packed, w.bias, w.out, c + r0 * ldc, ldc,
                      res ? res + r0 * ldr : nullptr, ldr);
}

template <class K>
at::Tensor block_operator(const at::Tensor& x_in, const at::Tensor& ln1_weight, const at::Tensor& ln1_bias,
                          double ln1_eps, const at::Tensor& ln2_weight, const at::Tensor& ln2_bias, double ln2_eps,
                          at::TensorList packed, at::TensorList biases, int64_t heads, double scale,
                          c10::string_view gelu_approximate, int64_t shares) {
  using T = typename K::T;
  using vitkit_avx512::Epilogue;
  TORCH_CHECK(K::here(), K::name, ": needs ", K::cpu);
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == K::dtype && x_in.device().is_cpu(), K::name, ": expected ",
              K::dtype_name, " tokens (B, T, D) on the CPU, got ", x_in.sizes(), " ", x_in.dtype());
  TORCH_CHECK(packed.size() == 4 && biases.size() == 4, K::name,
              ": expected the q;k;v, projection, fc1 and fc2 layers' weights and biases, four of each");
  const at::Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), tokens = x.size(1), D = x.size(2), rows = B * tokens;
  TORCH_CHECK(heads > 0 && D % heads == 0 && K::heads_apply(D / heads), K::name, ": width ", D, " in ", heads,
              " heads: ", K::heads_message);
  TORCH_CHECK(gelu_approximate == "none" || gelu_approximate == "tanh", K::name,
              ": gelu_approximate must be none or tanh, got ", gelu_approximate);
  const auto qkv = packed_layer<K>(packed[0], biases[0], D, "q;k;v");
  const auto proj = packed_layer<K>(packed[1], biases[1], D, "projection");
  const auto fc1 = packed_layer<K>(packed[2], biases[2], D, "fc1");
  const auto fc2 = packed_layer<K>(packed[3], biases[3], fc1.out, "fc2");
  TORCH_CHECK(qkv.out == 3 * D && proj.out == D && fc2.out == D, K::name, ": layer widths ", qkv.out, ", ",
              proj.out, ", ", fc2.out, " do not fit width ", D);
  for (const at::Tensor& t : {ln1_weight, ln1_bias, ln2_weight, ln2_bias})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == D, K::name,
                ": the LayerNorms' weights and biases must be ", D, " contiguous fp32 values");
  const int64_t hidden = fc1.out;
  at::Tensor out = at::empty_like(x);
  if (rows == 0) return out;  // no tokens (B or T zero): nothing to compute
  at::Tensor normed = at::empty({rows, D}, x.options());  // LN1's, then LN2's output
  at::Tensor qkv_rows = at::empty({rows, 3 * D}, x.options());
  at::Tensor merged = at::empty({rows, D}, x.options());
  at::Tensor hidden_rows = at::empty({rows, hidden}, x.options());
  const T* xp = K::data(x);
  T *outp = K::data(out), *np = K::data(normed), *qkvp = K::data(qkv_rows), *mp = K::data(merged);
  T* hp = K::data(hidden_rows);
  const float *n1w = ln1_weight.const_data_ptr<float>(), *n1b = ln1_bias.const_data_ptr<float>();
  const float *n2w = ln2_weight.const_data_ptr<float>(), *n2b = ln2_bias.const_data_ptr<float>();
  const float eps1 = static_cast<float>(ln1_eps), eps2 = static_cast<float>(ln2_eps);
  const bool tanh = gelu_approximate == "tanh";
  // The MLP's rows a block: each block streams the projection's and the MLP's weights past its rows, and its
  // hidden activations stay in L2 (48 x hidden: 288 KiB in fp32 for ViT-S/16) where the block is small.
  constexpr int64_t kRows = K::mlp_rows;

  run_block(
      shares, rows, B * heads,
      [&](int64_t r0, int64_t r1) {  // LN1 and the q;k;v product
        K::layer_norm(xp + r0 * D, r1 - r0, D, n1w, n1b, eps1, np + r0 * D);
        layer_product<K, Epilogue::kStore>(qkv, np, D, r0, r1, qkvp, 3 * D);
      },
      [&](int64_t p0, int64_t p1) {
        K::attention(static_cast<const T*>(qkvp), tokens, D, heads, p0, p1, static_cast<float>(scale), mp);
      },
      [&](int64_t r0, int64_t r1) {  // (2): projection and residual; (3): the MLP and residual
        row_blocks(r0, r1, K::MR, kRows, [&](int64_t b0, int64_t b1) {
          layer_product<K, Epilogue::kResidual>(proj, mp, D, b0, b1, outp, D, xp, D);
          K::layer_norm(outp + b0 * D, b1 - b0, D, n2w, n2b, eps2, np + b0 * D);
          if (tanh) {
            layer_product<K, Epilogue::kGeluTanh>(fc1, np, D, b0, b1, hp, hidden);
          } else {
            layer_product<K, Epilogue::kGelu>(fc1, np, D, b0, b1, hp, hidden);
          }
          layer_product<K, Epilogue::kResidual>(fc2, hp, hidden, b0, b1, outp, D, outp, D);
        });
      });
  return out;
}

}  // namespace vitkit

// vitkit::fp32_block: one encoder block of the fp32 model (eq. 2 and 3) as one parallel region
// (block_operator.h), on vitkit's fp32 products for AVX-512 CPUs (fp32_gemm.h) or for AVX2 + FMA CPUs
// (fp32_gemm_avx2.h), whichever the CPU runs; each packs the weights into panels of its own width.
//
// Run operator by operator, a block is some fifteen parallel regions (each LayerNorm, product, attention, add),
// and at each the threads meet; at batch 1 the products are short (ViT-S/16: 0.3-1.2 ms each on 2 cores) and
// the meetings, with the passes over memory between the operators, cost several per cent of the call. Here
// the block has two meeting points, and its MLP's hidden activations stay in L2; its attention runs on
// attention_kernels.h's tiles. fp32_block_pack packs a weight for it.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "attention_kernels.h"
#include "block_operator.h"
#include "fp32_gemm.h"
#include "fp32_gemm_avx2.h"

namespace {

bool on_avx512() { return row_isa() == RowIsa::kAvx512; }
bool fp32_block_here() { return row_isa() != RowIsa::kSse2; }  // AVX-512, or AVX2 and FMA

// Every layer's output width is a multiple of this, on either instruction set (vitkit.cpu.fp32_block.PANEL).
constexpr int64_t kWidthStep = vitkit_f32::NR;

// W (N, K) fp32, N a multiple of 64 -> panels (N / NR, K, NR) for fp32_block: NR = 64 on AVX-512, 16 on AVX2.
at::Tensor fp32_block_pack(const at::Tensor& weight) {
  TORCH_CHECK(fp32_block_here(), "fp32_block_pack: needs a CPU with AVX-512, or AVX2 and FMA");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu() &&
                  weight.size(0) > 0 && weight.size(0) % kWidthStep == 0 && weight.size(1) > 0,
              "fp32_block_pack: expected an fp32 weight (out, in) on the CPU with out a multiple of ",
              kWidthStep, ", got ", weight.sizes(), " ", weight.dtype(), " on ", weight.device());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t nr = on_avx512() ? vitkit_f32::NR : vitkit_f32_avx2::NR;
  at::Tensor packed = at::empty({N / nr, K, nr}, w.options());
  if (on_avx512()) {
    vitkit_f32::pack_weight(w.const_data_ptr<float>(), N, K, packed.mutable_data_ptr<float>());
  } else {
    vitkit_f32_avx2::pack_weight(w.const_data_ptr<float>(), N, K, packed.mutable_data_ptr<float>());
  }
  return packed;
}

// block_operator.h's policy: fp32 activations and panels, the fp32 attention tiles; the products and
// LayerNorm of Kernels (AVX-512 or AVX2, below).
template <class Kernels>
struct Fp32 {
  using T = float;
  static constexpr const char* name = "fp32_block";
  static constexpr const char* dtype_name = "fp32";
  static constexpr const char* cpu = Kernels::cpu;
  static constexpr const char* packed_layout = "fp32_block_pack";
  static constexpr const char* heads_message = "the width must be divisible by the heads";
  static constexpr at::ScalarType dtype = at::kFloat;
  static constexpr int64_t MR = Kernels::MR, NR = Kernels::NR, mlp_rows = Kernels::mlp_rows;
  static bool here() { return Kernels::here(); }
  static bool heads_apply(int64_t) { return true; }  // attention_pairs takes any width (sgemm past the tiles)
  static bool packed_fits(const at::Tensor& p, int64_t in) {
    return p.dim() == 3 && p.size(1) == in && p.size(2) == NR && (p.size(0) * NR) % kWidthStep == 0;
  }
  static const float* data(const at::Tensor& t) { return t.const_data_ptr<float>(); }
  static float* data(at::Tensor& t) { return t.mutable_data_ptr<float>(); }
  static void layer_norm(const float* x, int64_t rows, int64_t D, const float* w, const float* b, float eps,
                         float* y) {
    Kernels::layer_norm(x, rows, D, w, b, eps, y);
  }
  static void attention(const float* qkv, int64_t tokens, int64_t D, int64_t heads, int64_t p0, int64_t p1,
                        float scale, float* out) {
    attention_pairs(qkv, tokens, D, heads, p0, p1, scale, out);
  }
  template <vitkit_avx512::Epilogue E>
  static void gemm(const float* x, int64_t lda, int64_t M, int64_t K, const float* packed, const float* bias,
                   int64_t N, float* c, int64_t ldc, const float* res, int64_t ldr) {
    Kernels::template gemm<E>(x, lda, M, K, packed, bias, N, c, ldc, res, ldr);
  }
};

struct Avx512 {
  static constexpr const char* cpu = "a CPU with AVX-512";
  static constexpr int64_t MR = vitkit_f32::MR, NR = vitkit_f32::NR, mlp_rows = 48;
  static bool here() { return on_avx512(); }
  static void layer_norm(const float* x, int64_t rows, int64_t D, const float* w, const float* b, float eps,
                         float* y) {
    vitkit_avx512::layer_norm_rows(x, D, rows, D, w, b, eps, y, D);
  }
  template <vitkit_avx512::Epilogue E>
  static void gemm(const float* x, int64_t lda, int64_t M, int64_t K, const float* packed, const float* bias,
                   int64_t N, float* c, int64_t ldc, const float* res, int64_t ldr) {
    vitkit_f32::gemm<E>(x, lda, M, K, packed, bias, N, c, ldc, res, ldr);
  }
};

struct Avx2 {
  static constexpr const char* cpu = "a CPU with AVX2 and FMA";
  // 96 rows of the MLP a block: half the passes of the weights past the rows of 48, 1.02-1.05x the block's
  // speed with 48 at ViT-S/16 and ViT-B/16 on 2 cores of an AMD EPYC (Zen 3), though ViT-S/16's hidden
  // activations (576 KiB) then overflow its 512 KiB L2
  static constexpr int64_t MR = vitkit_f32_avx2::MR, NR = vitkit_f32_avx2::NR, mlp_rows = 96;
  static bool here() { return row_isa() == RowIsa::kAvx2; }
  static void layer_norm(const float* x, int64_t rows, int64_t D, const float* w, const float* b, float eps,
                         float* y) {
    vitkit_f32_avx2::layer_norm_rows(x, D, rows, D, w, b, eps, y, D);
  }
  template <vitkit_avx512::Epilogue E>
  static void gemm(const float* x, int64_t lda, int64_t M, int64_t K, const float* packed, const float* bias,
                   int64_t N, float* c, int64_t ldc, const float* res, int64_t ldr) {
    vitkit_f32_avx2::gemm<E>(x, lda, M, K, packed, bias, N, c, ldc, res, ldr);
  }
};

at::Tensor fp32_block(const at::Tensor& x, const at::Tensor& ln1_weight, const at::Tensor& ln1_bias,
                      double ln1_eps, const at::Tensor& ln2_weight, const at::Tensor& ln2_bias, double ln2_eps,
                      at::TensorList packed, at::TensorList biases, int64_t heads, double scale,
                      c10::string_view gelu_approximate, int64_t shares) {
  TORCH_CHECK(fp32_block_here(), "fp32_block: needs a CPU with AVX-512, or AVX2 and FMA");
  if (!on_avx512())
    return vitkit::block_operator<Fp32<Avx2>>(x, ln1_weight, ln1_bias, ln1_eps, ln2_weight, ln2_bias, ln2_eps,
                                              packed, biases, heads, scale, gelu_approximate, shares);
  return vitkit::block_operator<Fp32<Avx512>>(x, ln1_weight, ln1_bias, ln1_eps, ln2_weight, ln2_bias, ln2_eps,
                                              packed, biases, heads, scale, gelu_approximate, shares);
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
  // whether this CPU runs the fp32 block (AVX-512, or AVX2 and FMA)
  m.def("fp32_block_here() -> bool", []() { return fp32_block_here(); });
}

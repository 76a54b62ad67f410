// vitkit::bf16_block: one encoder block of the bf16 model (eq. 2 and 3) as one parallel region
// (block_operator.h, as fp32_block.cpp's), on vitkit's bf16 products for CPUs with AVX512-BF16 (bf16_gemm.h),
// the bf16 LayerNorm kernel (layer_norm_bf16.h) and the bf16 attention tiles (attention_bf16.h, reading the
// bf16 projection in place). Every value the layers' fused products round to bf16 is rounded here too (each
// product's output with its bias, residual and GELU, each LayerNorm's output), so the block computes what the
// bf16 model's layers do, up to the order of the fp32 sums. bf16_block_pack packs a weight for it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "attention_bf16.h"
#include "bf16_gemm.h"
#include "block_operator.h"
#include "layer_norm_bf16.h"

namespace {

bool bf16_block_here() { return vitkit_bf16_norm::here(); }

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

// block_operator.h's policy: bf16 activations and panels (as uint16_t), the bf16 LayerNorm and attention tiles.
struct Bf16 {
  using T = uint16_t;
  static constexpr const char* name = "bf16_block";
  static constexpr const char* dtype_name = "bf16";
  static constexpr const char* cpu = "a CPU with AVX512-BF16";
  static constexpr const char* packed_layout = "bf16_block_pack";
  static constexpr const char* heads_message =
      "the width must be divisible by the heads, and the attention's bf16 tiles need heads of 16 to 128 dims "
      "in multiples of 16";
  static constexpr at::ScalarType dtype = at::kBFloat16;
  static constexpr int64_t MR = vitkit_bf16::MR, NR = vitkit_bf16::NR;
  static constexpr int64_t mlp_rows = 48;
  static bool here() { return bf16_block_here(); }
  static bool heads_apply(int64_t head_dim) { return bf16_tiles_apply(head_dim); }
  static bool packed_fits(const at::Tensor& p, int64_t in) {
    return p.dim() == 4 && p.size(1) * 2 == in && p.size(2) == NR && p.size(3) == 2;
  }
  static const uint16_t* data(const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>());
  }
  static uint16_t* data(at::Tensor& t) { return bits(t); }
  static void layer_norm(const uint16_t* x, int64_t rows, int64_t D, const float* w, const float* b, float eps,
                         uint16_t* y) {
    thread_local std::vector<float> row;  // one row's scratch, per thread
    row.resize((D + 15) / 16 * 16);
    vitkit_bf16_norm::layer_norm_rows(x, rows, D, w, b, eps, row.data(), y);
  }
  static void attention(const uint16_t* qkv, int64_t tokens, int64_t D, int64_t heads, int64_t p0, int64_t p1,
                        float scale, uint16_t* out) {
    attention_pairs_bf16(qkv, tokens, D, heads, p0, p1, scale, out);
  }
  template <vitkit_avx512::Epilogue E>
  static void gemm(const uint16_t* x, int64_t lda, int64_t M, int64_t K, const uint16_t* packed,
                   const float* bias, int64_t N, uint16_t* c, int64_t ldc, const uint16_t* res, int64_t ldr) {
    vitkit_bf16::gemm<E>(x, lda, M, K, packed, bias, N, c, ldc, res, ldr);
  }
};

at::Tensor bf16_block(const at::Tensor& x, const at::Tensor& ln1_weight, const at::Tensor& ln1_bias,
                      double ln1_eps, const at::Tensor& ln2_weight, const at::Tensor& ln2_bias, double ln2_eps,
                      at::TensorList packed, at::TensorList biases, int64_t heads, double scale,
                      c10::string_view gelu_approximate, int64_t shares) {
  return vitkit::block_operator<Bf16>(x, ln1_weight, ln1_bias, ln1_eps, ln2_weight, ln2_bias, ln2_eps, packed,
                                      biases, heads, scale, gelu_approximate, shares);
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

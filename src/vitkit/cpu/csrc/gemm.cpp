// vitkit::gemm_pack / gemm_linear: an fp32 linear layer, y = x W^T + b (+ residual), for AVX2 + FMA CPUs.
//
// On CPUs without AVX-512, MKL's and oneDNN's fp32 products reach 130-160 GFLOP/s (2 cores of an AMD EPYC
// Zen 3) on a ViT's 197-row activations, where a product that keeps its operands in the caches reaches 180-190
// (ONNX Runtime's MLAS does). This one is the textbook scheme (Goto's): the weight is packed once into panels of
// 16 output columns, k-major (gemm_pack); the product walks blocks of NC columns (one task each, split among the
// threads), KC steps of the inner dimension and MC rows, so that a panel's block of the weight (16 x KC floats)
// stays in L1 and the MC x KC block of x in L2, and computes 6 x 16 tiles of y in 12 AVX registers with
// broadcast FMAs: fp32_gemm_avx2.h's tile, which the fp32 block operator runs on AVX2 too. The bias and the
// residual initialise the tile on the first KC step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>

#include "fp32_gemm_avx2.h"
#include "panels.h"

#define VITKIT_AVX2 __attribute__((target("avx2,fma")))

namespace {

using vitkit_f32_avx2::KC;  // inner-dimension step
using vitkit_f32_avx2::MC;  // rows a block: 96 x KC of x (144 KiB) and NC x KC of W (192 KiB) in L2
using vitkit_f32_avx2::MR;  // rows of a tile
using vitkit_f32_avx2::NR;  // columns of a panel, of a tile

// One MR x NR tile (R <= MR rows) of c over kc steps: c = (first ? bias (+ res when given) : c) + a b.
template <int R>
VITKIT_AVX2 void tile(const float* a, int64_t lda, const float* b, float* c, int64_t ldc, int64_t kc,
                      const float* bias, bool first, const float* res) {
  using vitkit_avx512::Epilogue;
  if (res) {
    vitkit_f32_avx2::tile<R, Epilogue::kResidual>(a, lda, b, kc, bias, first, false, c, ldc, res, ldc);
  } else {
    vitkit_f32_avx2::tile<R, Epilogue::kStore>(a, lda, b, kc, bias, first, false, c, ldc, nullptr, 0);
  }
}

using Tile = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, const float*, bool,
                      const float*);
const Tile TILES[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Columns a task: the widest of 128, 64, 32 that splits the panels evenly among the threads.
int64_t block_columns(int64_t n, int64_t threads) {
  for (int64_t nc : {128, 64, 32}) {
    if (n % nc == 0 && (n / nc) % threads == 0) return nc;
  }
  return 128;
}

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "vitkit gemm_pack: expected an fp32 weight (out, in) on the CPU, got ", w.sizes(), " ", w.dtype(),
              " on ", w.device());
  TORCH_CHECK(w.size(0) % NR == 0 && w.size(0) > 0 && w.size(1) > 0, "vitkit gemm_pack: out features ",
              w.size(0), " must be a positive multiple of ", NR);
}

// W (N, K), nn.Linear's layout -> panels (N / 16, K, 16) (panels.h).
at::Tensor gemm_pack(const at::Tensor& weight) {
  check_weight(weight);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({N / NR, K, NR}, w.options());
  const float* src = w.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, N / NR, 1, [&](int64_t p0, int64_t p1) { vitkit::pack_panels(src, K, NR, p0, p1, dst); });
  return out;
}

at::Tensor gemm_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(),
              "vitkit gemm_linear: expected a weight from gemm_pack, got ", packed.sizes());
  const int64_t K = packed.size(1), N = packed.size(0) * NR;
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() >= 1 &&
                  input.size(-1) == K,
              "vitkit gemm_linear: expected fp32 input (..., ", K, ") on the CPU, got ", input.sizes(), " ",
              input.dtype(), " on ", input.device());
  const at::Tensor x = input.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t M = x.numel() / K;
  if (M == 0) return out;
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "vitkit gemm_linear: bias of ", N, " fp32 values expected, got ", bias->sizes());
    b = bias->const_data_ptr<float>();
  }
  at::Tensor res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == out.sizes() && residual->scalar_type() == at::kFloat,
                "vitkit gemm_linear: residual of shape ", out.sizes(), " expected, got ", residual->sizes());
    res = residual->contiguous();
  }
  const float* A = x.const_data_ptr<float>();
  const float* B = packed.const_data_ptr<float>();
  const float* R = res.defined() ? res.const_data_ptr<float>() : nullptr;
  float* C = out.mutable_data_ptr<float>();
  const int64_t nc = block_columns(N, at::get_num_threads());
  at::parallel_for(0, (N + nc - 1) / nc, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * nc, n1 = std::min(N, n0 + nc);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const bool first = k0 == 0;
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
          const int64_t m1 = std::min(M, m0 + MC);
          for (int64_t n = n0; n < n1; n += NR) {
            const float* panel = B + (n / NR) * K * NR + k0 * NR;
            for (int64_t m = m0; m < m1; m += MR) {
              const int64_t rows = std::min(MR, m1 - m);
              TILES[rows](A + m * K + k0, K, panel, C + m * N + n, N, kc, b ? b + n : nullptr, first,
                          first && R ? R + m * N + n : nullptr);
            }
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitkit, m) {
  m.def("gemm_pack(Tensor weight) -> Tensor");
  m.def("gemm_linear(Tensor input, Tensor packed, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.impl("gemm_pack", c10::DispatchKey::CPU, TORCH_FN(gemm_pack));
  m.impl("gemm_linear", c10::DispatchKey::CPU, TORCH_FN(gemm_linear));
}

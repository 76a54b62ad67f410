// vitkit::layer_norm_bf16: LayerNorm over the last dimension of a bf16 tensor, for a bf16 model's inference on
// CPUs with AVX512-BF16. Each row is widened to fp32, its mean and variance taken in fp32 (two passes over the
// row, which stays in L1), and (x - mean) / sqrt(var + eps) * weight + bias rounded to bf16 (to nearest even)
// as it is stored. PyTorch's bf16 LayerNorm computes the same in fp32 through more general code: on an AMD EPYC
// (Zen 4), 2 threads, 16 x 197 rows of 384, about 2.3x the time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include "layer_norm_bf16.h"
#endif

namespace {

#if defined(__x86_64__)
using vitkit_bf16_norm::here;
using vitkit_bf16_norm::layer_norm_rows;

#else
bool here() { return false; }
void layer_norm_rows(const uint16_t*, int64_t, int64_t, const float*, const float*, float, float*, uint16_t*) {}
#endif

at::Tensor layer_norm_bf16(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  TORCH_CHECK(here(), "layer_norm_bf16: needs a CPU with AVX512-BF16");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu() && x_in.dim() >= 1,
              "layer_norm_bf16: expected a bf16 tensor on the CPU, got ", x_in.dtype(), " on ", x_in.device());
  const int64_t D = x_in.size(-1);
  TORCH_CHECK(D > 0 && weight.dim() == 1 && bias.dim() == 1 && weight.size(0) == D && bias.size(0) == D &&
                  weight.device().is_cpu() && bias.device().is_cpu(),
              "layer_norm_bf16: weight ", weight.sizes(), " and bias ", bias.sizes(), " for rows of ", D);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous(), b = bias.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t rows = x.numel() / D;
  const auto* src = reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>());
  const float* wp = w.const_data_ptr<float>();
  const float* bp = b.const_data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row((D + 15) / 16 * 16);
    layer_norm_rows(src + r0 * D, r1 - r0, D, wp, bp, e, row.data(), dst + r0 * D);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitkit, m) {
  m.def("layer_norm_bf16(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.impl("layer_norm_bf16", c10::DispatchKey::CPU, TORCH_FN(layer_norm_bf16));
  m.def("layer_norm_bf16_here() -> bool", []() { return here(); });
}

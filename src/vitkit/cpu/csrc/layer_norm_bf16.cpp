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
#include <immintrin.h>
#endif

namespace {

#if defined(__x86_64__)
#define VITKIT_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool here() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

// The r < 16 (or 16) first lanes.
VITKIT_AVX512_BF16 inline __mmask16 lanes(int64_t r) {
  return r >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << r) - 1);
}

VITKIT_AVX512_BF16 inline __m512 widen(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// rows x D bf16 (x) -> rows x D bf16 (y); w, b: D floats; row: a scratch of D floats. avx512_math.h's
// layer_norm_rows in the same order (the same bits), with the widening fused into its first pass and the
// rounding into its last: calling it on a widened copy costs a pass more, 12 % of this kernel's time.
VITKIT_AVX512_BF16 void layer_norm_rows(const uint16_t* x, int64_t rows, int64_t D, const float* w, const float* b,
                                        float eps, float* row, uint16_t* y) {
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* xi = x + i * D;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = widen(xi + d, lanes(D - d));
      _mm512_storeu_ps(row + d, v);  // D rounded up to 16: the scratch has room
      sum = _mm512_add_ps(sum, v);
    }
    const float mean = _mm512_reduce_add_ps(sum) / static_cast<float>(D);
    const __m512 mv = _mm512_set1_ps(mean);
    __m512 sq = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 c = _mm512_maskz_sub_ps(lanes(D - d), _mm512_loadu_ps(row + d), mv);
      sq = _mm512_fmadd_ps(c, c, sq);
    }
    const float rstd = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(D) + eps);
    const __m512 rv = _mm512_set1_ps(rstd);
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = lanes(D - d);
      const __m512 c = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + d), mv), rv);
      const __m512 out = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(m, w + d), _mm512_maskz_loadu_ps(m, b + d));
      _mm256_mask_storeu_epi16(y + i * D + d, m, (__m256i)_mm512_cvtneps_pbh(out));
    }
  }
}
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

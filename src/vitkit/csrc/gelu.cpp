// vitkit::gelu / gelu_ / gelu_backward: GELU and its derivative in fp32 on the CPU, exact (erf) or with
// PyTorch's tanh approximation, from piecewise polynomials instead of erf or tanh.
//
// Both flavours are x Phi(x) with Phi(-x) = 1 - Phi(x), so with a = |x| and E(a) = Phi(a) - 1/2:
//
//   GELU(x)  = x/2 + a E(a)
//   GELU'(x) = 1/2 + sign(x) D(a),   D(a) = E(a) + a E'(a)
//
// E and D are smooth on [0, 6] and constant beyond it (E(6) = 1/2 - 1e-9 with erf, 1/2 - 3e-11 with tanh), so each
// is 16 polynomials of degree 5 on pieces of width 6/16, which one AVX-512 register holds coefficient by
// coefficient: a permute picks each lane's coefficients, and the value costs 5 FMAs where erf costs a division,
// an exp and a polynomial. The polynomials interpolate E and D at the Chebyshev nodes of each piece, computed
// in double when the library loads; their error is ~1.5e-8 for E and ~4e-8 for D (float rounding on top), below
// PyTorch's own fp32 GELU (~1e-6 from exact). From |x| = 6 on, E = D = 1/2: GELU(x) = x and GELU'(x) = 1 for
// large x, 0 and 0 for large -x, exactly.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "vector_math.h"

namespace {

using namespace vitkit_vec;

constexpr int kPieces = 16;  // one vector's lanes
constexpr int kDegree = 5;
constexpr double kRange = 6.0;
constexpr float kLast = static_cast<float>(kRange) * 0.99999994f;  // the largest float in the last piece

// Coefficient j of every piece's polynomial in u = a - (the piece's centre), lane i for piece i.
struct Pieces {
  vfloat c[kDegree + 1];
};

// The polynomial of degree kDegree through f at the Chebyshev nodes of each piece, in powers of u: a small
// Vandermonde system per piece, solved in double by Gauss-Jordan elimination with partial pivoting.
template <class F>
Pieces interpolate(F f) {
  Pieces out{};
  constexpr int n = kDegree + 1;
  const double width = kRange / kPieces;
  for (int piece = 0; piece < kPieces; ++piece) {
    const double centre = (piece + 0.5) * width;
    double a[n][n + 1];
    for (int k = 0; k < n; ++k) {
      const double u = 0.5 * width * std::cos((2 * k + 1) * M_PI / (2 * n));
      double power = 1.0;
      for (int j = 0; j < n; ++j, power *= u) a[k][j] = power;
      a[k][n] = f(centre + u);
    }
    for (int col = 0; col < n; ++col) {
      int pivot = col;
      for (int r = col + 1; r < n; ++r)
        if (std::fabs(a[r][col]) > std::fabs(a[pivot][col])) pivot = r;
      for (int j = 0; j <= n; ++j) std::swap(a[col][j], a[pivot][j]);
      for (int r = 0; r < n; ++r) {
        if (r == col) continue;
        const double m = a[r][col] / a[col][col];
        for (int j = col; j <= n; ++j) a[r][j] -= m * a[col][j];
      }
    }
    for (int j = 0; j < n; ++j) out.c[j][piece] = static_cast<float>(a[j][n] / a[j][j]);
  }
  return out;
}

const double kInvSqrt2 = 1.0 / std::sqrt(2.0);
const double kInvSqrt2Pi = 1.0 / std::sqrt(2.0 * M_PI);
const double kTanhScale = std::sqrt(2.0 / M_PI);  // tanh(sqrt(2/pi) (x + 0.044715 x^3)), PyTorch's "tanh"
constexpr double kTanhCubic = 0.044715;

double erf_half(double a) { return 0.5 * std::erf(a * kInvSqrt2); }
double tanh_half(double a) { return 0.5 * std::tanh(kTanhScale * (a + kTanhCubic * a * a * a)); }

// E and D (above) of each flavour.
const Pieces kErfE = interpolate(erf_half);
const Pieces kErfD = interpolate([](double a) { return erf_half(a) + a * kInvSqrt2Pi * std::exp(-0.5 * a * a); });
const Pieces kTanhE = interpolate(tanh_half);
const Pieces kTanhD = interpolate([](double a) {
  const double t = std::tanh(kTanhScale * (a + kTanhCubic * a * a * a));
  return 0.5 * t + 0.5 * a * (1.0 - t * t) * kTanhScale * (1.0 + 3.0 * kTanhCubic * a * a);
});

// The piecewise polynomial at a >= 0, and 1/2 (the limit of E and D) from kRange on. NaN gives 1/2 too; the
// callers keep it NaN.
VITKIT_INLINE vfloat evaluate(const Pieces& p, vfloat a) {
  const vfloat clamped = a < static_cast<float>(kRange) ? a : splat(kLast);
  const vint piece = __builtin_convertvector(clamped * static_cast<float>(kPieces / kRange), vint);
  const vfloat u = clamped - (__builtin_convertvector(piece, vfloat) + 0.5f) * static_cast<float>(kRange / kPieces);
  vfloat y = __builtin_shuffle(p.c[kDegree], piece);
  for (int j = kDegree - 1; j >= 0; --j) y = y * u + __builtin_shuffle(p.c[j], piece);
  return a < static_cast<float>(kRange) ? y : splat(0.5f);
}

VITKIT_INLINE vfloat gelu_vector(const Pieces& e, vfloat x) {
  const vfloat a = x < 0 ? -x : x;
  return 0.5f * x + a * evaluate(e, a);
}

VITKIT_INLINE vfloat gelu_grad_vector(const Pieces& d, vfloat x, vfloat grad) {
  const vfloat a = x < 0 ? -x : x;
  const vfloat dd = evaluate(d, a);
  const vfloat slope = 0.5f + (x < 0 ? -dd : dd);
  return x != x ? x : grad * slope;  // NaN in, NaN out
}

// out[i] = GELU(x[i]); out may be x. The tail (fewer than 16) makes one more vector.
VITKIT_CLONES void gelu_span(const Pieces& e, const float* x, float* out, int64_t n) {
  const int64_t nv = n / kWidth * kWidth, r = n - nv;
  for (int64_t i = 0; i < nv; i += kWidth) store(out + i, gelu_vector(e, load(x + i)));
  if (r) store_part(out + nv, gelu_vector(e, load_part(x + nv, r, 0.f)), r);
}

// out[i] = grad[i] GELU'(x[i]).
VITKIT_CLONES void gelu_backward_span(const Pieces& d, const float* grad, const float* x, float* out, int64_t n) {
  const int64_t nv = n / kWidth * kWidth, r = n - nv;
  for (int64_t i = 0; i < nv; i += kWidth) store(out + i, gelu_grad_vector(d, load(x + i), load(grad + i)));
  if (r) store_part(out + nv, gelu_grad_vector(d, load_part(x + nv, r, 0.f), load_part(grad + nv, r, 0.f)), r);
}

bool is_tanh(c10::string_view approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh", "vitkit gelu: approximate must be 'none' or 'tanh', got '",
              std::string(approximate), "'");
  return approximate == "tanh";
}

void check_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "vitkit gelu: expected ", what,
              " as fp32 on the CPU, got ", x.dtype(), " on ", x.device());
}

// Elements per task: a task's share is ~64 KB read, and a ViT-S/16 hidden activation at batch 1 (197 x 1536)
// still splits across threads.
constexpr int64_t kGrain = 16384;

void gelu_into(const at::Tensor& x, at::Tensor& out, c10::string_view approximate) {
  const Pieces& e = is_tanh(approximate) ? kTanhE : kErfE;
  const float* src = x.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t i0, int64_t i1) { gelu_span(e, src + i0, dst + i0, i1 - i0); });
}

at::Tensor gelu(const at::Tensor& x_in, c10::string_view approximate) {
  check_input(x_in, "the input");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  gelu_into(x, out, approximate);
  return out;
}

at::Tensor& gelu_(at::Tensor& x, c10::string_view approximate) {
  check_input(x, "the input");
  TORCH_CHECK(x.is_contiguous(), "vitkit gelu_: the input must be contiguous to be written in place");
  gelu_into(x, x, approximate);
  return x;
}

at::Tensor gelu_backward(const at::Tensor& grad_in, const at::Tensor& x_in, c10::string_view approximate) {
  check_input(x_in, "the input");
  check_input(grad_in, "the gradient");
  TORCH_CHECK(grad_in.sizes() == x_in.sizes(), "vitkit gelu_backward: gradient ", grad_in.sizes(), " for an input of ",
              x_in.sizes());
  const Pieces& d = is_tanh(approximate) ? kTanhD : kErfD;
  const at::Tensor x = x_in.contiguous(), grad = grad_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const float* xs = x.const_data_ptr<float>();
  const float* gs = grad.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain,
                   [&](int64_t i0, int64_t i1) { gelu_backward_span(d, gs + i0, xs + i0, dst + i0, i1 - i0); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitkit, m) {
  m.def("gelu(Tensor x, str approximate) -> Tensor");
  m.def("gelu_(Tensor(a!) x, str approximate) -> Tensor(a!)");
  m.def("gelu_backward(Tensor grad, Tensor x, str approximate) -> Tensor");
  m.impl("gelu", c10::DispatchKey::CPU, TORCH_FN(gelu));
  m.impl("gelu_", c10::DispatchKey::CPU, TORCH_FN(gelu_));
  m.impl("gelu_backward", c10::DispatchKey::CPU, TORCH_FN(gelu_backward));
}

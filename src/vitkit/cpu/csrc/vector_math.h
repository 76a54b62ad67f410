// Vectors of floats for vitkit's elementwise loops (the attention's softmax rows), written with GCC's vector
// extensions so that one source serves every x86-64 CPU. `vfloat` is 16 floats, for the AVX-512 tiles; a row
// loop is a body templated on its vector type and run by `widest`, which calls it from a function compiled for
// the widest vectors this CPU runs: 16 floats under AVX-512 (unless the library is held to AVX2, cpu_hold.h),
// 8 under AVX2 + FMA, 4 on plain x86-64. (Vectors wider than the target's registers, as 16 floats compiled for
// AVX2 are, live on the stack: the softmax ran about 2x slower so.) The helpers below are always inlined and take
// the instruction set of the function they are inlined into.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_hold.h"

#define VITKIT_INLINE inline __attribute__((always_inline))

namespace vitkit_vec {

typedef float vfloat __attribute__((vector_size(64)));
typedef float vfloat8 __attribute__((vector_size(32)));
typedef float vfloat4 __attribute__((vector_size(16)));
constexpr int64_t kWidth = 16;

// The floats in a vector of type V.
template <class V>
constexpr int64_t lanes = sizeof(V) / sizeof(float);

template <class V = vfloat>
VITKIT_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V>
VITKIT_INLINE void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
template <class V = vfloat>
VITKIT_INLINE V splat(float s) {
  return V{} + s;
}

// exp(x) for x <= 0, to about 2 ulp: Cephes' degree-6 polynomial on x - n ln 2, n = round(x / ln 2)
// (rounded by adding and subtracting 1.5 * 2^23), times 2^n built in the exponent bits. exp(-87) ~ 1.6e-38 is
// the floor; it is 0 next to a softmax row's largest term, which is 1.
template <class V>
VITKIT_INLINE V exp_nonpositive(V x) {
  using VI = decltype(x < x);  // the int32 vector of V's width
  x = x < -87.0f ? splat<V>(-87.0f) : x;
  const V magic = splat<V>(12582912.0f);
  const V t = x * 1.44269504088896341f + magic;
  const V n = t - magic;
  const VI exponent = (VI)t - (VI)magic;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V y = splat<V>(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  return y * (V)((exponent + 127) << 23);
}

template <class V>
VITKIT_INLINE float sum_lanes(V v) {
  float s = 0.f;
  for (int64_t i = 0; i < lanes<V>; ++i) s += v[i];
  return s;
}

template <class V>
VITKIT_INLINE float max_lanes(V v) {
  float m = v[0];
  for (int64_t i = 1; i < lanes<V>; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

#if defined(__x86_64__)
// Body::run<V>(args...) compiled for each vector width, and the call on the widest this CPU runs.
template <class Body, class... A>
__attribute__((target("avx512f"))) auto run_avx512(A... a) {
  return Body::template run<vfloat>(a...);
}
template <class Body, class... A>
__attribute__((target("avx2,fma"))) auto run_avx2(A... a) {
  return Body::template run<vfloat8>(a...);
}

enum class RowIsa { kSse2, kAvx2, kAvx512 };

// The widest vectors this CPU runs, as vitkit's operators see it (cpu_hold.h): the row loops' path here, and
// the AVX-512 check of the attention tiles and the fp32 block. static: a library built held to AVX2 and one
// built without may share a process, each with its own answer.
[[maybe_unused]] static RowIsa row_isa() {
  static const RowIsa isa = VITKIT_AVX512_HAS("avx512f") ? RowIsa::kAvx512
                            : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? RowIsa::kAvx2
                                                                                               : RowIsa::kSse2;
  return isa;
}
#endif

template <class Body, class... A>
VITKIT_INLINE auto widest(A... a) {
#if defined(__x86_64__)
  switch (row_isa()) {
    case RowIsa::kAvx512: return run_avx512<Body>(a...);
    case RowIsa::kAvx2: return run_avx2<Body>(a...);
    default: break;
  }
#endif
  return Body::template run<vfloat4>(a...);
}

}  // namespace vitkit_vec

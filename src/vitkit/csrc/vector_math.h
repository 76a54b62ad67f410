// Vectors of 16 floats for vitkit's elementwise loops (softmax rows, GELU), written with GCC's vector
// extensions so that one source serves every x86-64 CPU: each function marked VITKIT_CLONES is compiled for
// AVX-512, AVX2 and plain x86-64, and the loader picks the best this CPU runs (target_clones). The inline helpers
// below are inlined into each clone and take its instruction set.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#define VITKIT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VITKIT_CLONES
#endif

namespace vitkit_vec {

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
constexpr int64_t kWidth = 16;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline vfloat splat(float s) { return vfloat{} + s; }

// exp(x) for x <= 0, to about 2 ulp: Cephes' degree-6 polynomial on x - n ln 2, n = round(x / ln 2)
// (rounded by adding and subtracting 1.5 * 2^23), times 2^n built in the exponent bits. exp(-87) ~ 1.6e-38 is
// the floor; it is 0 next to a softmax row's largest term, which is 1.
inline vfloat exp_nonpositive(vfloat x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vfloat magic = splat(12582912.0f);
  const vfloat t = x * 1.44269504088896341f + magic;
  const vfloat n = t - magic;
  const vint exponent = (vint)t - (vint)magic;
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  return y * (vfloat)((exponent + 127) << 23);
}

inline float sum_lanes(vfloat v) {
  float s = 0.f;
  for (int64_t i = 0; i < kWidth; ++i) s += v[i];
  return s;
}

inline float max_lanes(vfloat v) {
  float m = v[0];
  for (int64_t i = 1; i < kWidth; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

}  // namespace vitkit_vec

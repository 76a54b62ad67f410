// Vectors of 16 floats for vitkit's elementwise loops (softmax rows, GELU), written with GCC's vector
// extensions so that one source serves every x86-64 CPU: each function marked VITKIT_CLONES is compiled for
// AVX-512, AVX2 and plain x86-64, and the loader picks the best this CPU runs (target_clones). The helpers below
// are always inlined into each clone and take its instruction set: an out-of-line copy would be compiled for
// plain x86-64 alone, and a clone that called it would pass its vectors by another ABI.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#define VITKIT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VITKIT_CLONES
#endif
#define VITKIT_INLINE inline __attribute__((always_inline))

namespace vitkit_vec {

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
constexpr int64_t kWidth = 16;

VITKIT_INLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
VITKIT_INLINE void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
VITKIT_INLINE vfloat splat(float s) { return vfloat{} + s; }

// exp(x) for x <= 0, to about 2 ulp: Cephes' degree-6 polynomial on x - n ln 2, n = round(x / ln 2)
// (rounded by adding and subtracting 1.5 * 2^23), times 2^n built in the exponent bits. exp(-87) ~ 1.6e-38 is
// the floor; it is 0 next to a softmax row's largest term, which is 1.
VITKIT_INLINE vfloat exp_nonpositive(vfloat x) {
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

// The first r < kWidth floats at p as a vector, its other lanes `fill`; and the first r lanes of v stored at p:
// the tail of a span in one vector.
VITKIT_INLINE vfloat load_part(const float* p, int64_t r, float fill) {
  float buf[kWidth];
  for (int64_t i = 0; i < kWidth; ++i) buf[i] = fill;
  std::memcpy(buf, p, r * sizeof(float));
  return load(buf);
}
VITKIT_INLINE void store_part(float* p, vfloat v, int64_t r) {
  float buf[kWidth];
  store(buf, v);
  std::memcpy(p, buf, r * sizeof(float));
}

VITKIT_INLINE float sum_lanes(vfloat v) {
  float s = 0.f;
  for (int64_t i = 0; i < kWidth; ++i) s += v[i];
  return s;
}

VITKIT_INLINE float max_lanes(vfloat v) {
  float m = v[0];
  for (int64_t i = 1; i < kWidth; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

}  // namespace vitkit_vec

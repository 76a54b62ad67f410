// vitkit::peak_ops: the CPU's arithmetic limit, measured. Each thread of torch's pool runs `iterations` rounds
// of one vector instruction on independent accumulators (enough of them to hide the instruction's latency, so
// that only its throughput bounds the loop) and nothing else: no loads, no stores. The ops one call performs
// (multiplies and adds counted apart, as GEMM FLOP counts do) over its wall time is the rate no product of
// that instruction can beat on these threads, at the clock the cores hold under that load.
//
// Kinds (the caller checks the CPU flags first; an unknown kind is an error):
//   fp32-avx512   vfmadd231ps zmm     16 lanes x 2 ops
//   fp32-avx2     vfmadd231ps ymm      8 lanes x 2 ops
//   bf16-avx512   vdpbf16ps zmm       16 lanes x 2 pairs x 2 ops
//   int8-avx512   vpdpbusd zmm (VNNI) 16 lanes x 4 pairs x 2 ops
//   int8-avxvnni  vpdpbusd ymm        8 lanes x 4 pairs x 2 ops
//   int8-avx2     vpmaddubsw + vpmaddwd + vpaddd ymm, the sequence int8 products use without VNNI:
//                 32 pairs x 2 ops per three instructions

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace {

// Twelve chains: 2 pipes x a latency of 4-6 cycles needs at least 8-12 in flight.
#define VK_ACC12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

__attribute__((target("avx512f"))) double fp32_avx512(int64_t n) {
  const __m512 a = _mm512_set1_ps(1e-7f), b = _mm512_set1_ps(0.5f);
#define VK_DECL(i) __m512 c##i = _mm512_set1_ps(static_cast<float>(i));
  VK_ACC12(VK_DECL)
#undef VK_DECL
  for (int64_t k = 0; k < n; ++k) {
#define VK_STEP(i) c##i = _mm512_fmadd_ps(a, b, c##i);
    VK_ACC12(VK_STEP)
#undef VK_STEP
  }
  __m512 s = _mm512_setzero_ps();
#define VK_SUM(i) s = _mm512_add_ps(s, c##i);
  VK_ACC12(VK_SUM)
#undef VK_SUM
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) double fp32_avx2(int64_t n) {
  const __m256 a = _mm256_set1_ps(1e-7f), b = _mm256_set1_ps(0.5f);
#define VK_DECL(i) __m256 c##i = _mm256_set1_ps(static_cast<float>(i));
  VK_ACC12(VK_DECL)
#undef VK_DECL
  for (int64_t k = 0; k < n; ++k) {
#define VK_STEP(i) c##i = _mm256_fmadd_ps(a, b, c##i);
    VK_ACC12(VK_STEP)
#undef VK_STEP
  }
  __m256 s = _mm256_setzero_ps();
#define VK_SUM(i) s = _mm256_add_ps(s, c##i);
  VK_ACC12(VK_SUM)
#undef VK_SUM
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  double total = 0;
  for (float v : out) total += v;
  return total;
}

__attribute__((target("avx512f,avx512bf16"))) double bf16_avx512(int64_t n) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f00);  // bf16 0.5
#define VK_DECL(i) __m512 c##i = _mm512_set1_ps(static_cast<float>(i));
  VK_ACC12(VK_DECL)
#undef VK_DECL
  for (int64_t k = 0; k < n; ++k) {
#define VK_STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
    VK_ACC12(VK_STEP)
#undef VK_STEP
  }
  __m512 s = _mm512_setzero_ps();
#define VK_SUM(i) s = _mm512_add_ps(s, c##i);
  VK_ACC12(VK_SUM)
#undef VK_SUM
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512vnni"))) double int8_avx512(int64_t n) {
  const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(-1);  // the sums wrap harmlessly
#define VK_DECL(i) __m512i c##i = _mm512_set1_epi32(i);
  VK_ACC12(VK_DECL)
#undef VK_DECL
  for (int64_t k = 0; k < n; ++k) {
#define VK_STEP(i) c##i = _mm512_dpbusd_epi32(c##i, a, b);
    VK_ACC12(VK_STEP)
#undef VK_STEP
  }
  __m512i s = _mm512_setzero_si512();
#define VK_SUM(i) s = _mm512_add_epi32(s, c##i);
  VK_ACC12(VK_SUM)
#undef VK_SUM
  return static_cast<double>(_mm512_reduce_add_epi32(s));
}

__attribute__((target("avx2,avxvnni"))) double int8_avxvnni(int64_t n) {
  const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(-1);
#define VK_DECL(i) __m256i c##i = _mm256_set1_epi32(i);
  VK_ACC12(VK_DECL)
#undef VK_DECL
  for (int64_t k = 0; k < n; ++k) {
#define VK_STEP(i) c##i = _mm256_dpbusd_avx_epi32(c##i, a, b);
    VK_ACC12(VK_STEP)
#undef VK_STEP
  }
  __m256i s = _mm256_setzero_si256();
#define VK_SUM(i) s = _mm256_add_epi32(s, c##i);
  VK_ACC12(VK_SUM)
#undef VK_SUM
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), s);
  double total = 0;
  for (int32_t v : out) total += v;
  return total;
}

// Without VNNI, u8 x s8 pairs are summed to int16 (vpmaddubsw), pairs of those to int32 against ones
// (vpmaddwd) and added to the accumulator. Each chain feeds its accumulator back as the u8 operand, or the
// compiler would hoist the two loop-invariant multiplies out of the loop. Ten chains: with twelve, the
// accumulators, operands and temporaries outgrow AVX2's 16 registers (measured: a third slower).
#define VK_ACC10(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)

__attribute__((target("avx2"))) double int8_avx2(int64_t n) {
  const __m256i b = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
#define VK_DECL(i) __m256i c##i = _mm256_set1_epi32(i);
  VK_ACC10(VK_DECL)
#undef VK_DECL
  for (int64_t k = 0; k < n; ++k) {
#define VK_STEP(i) c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_maddubs_epi16(c##i, b), ones));
    VK_ACC10(VK_STEP)
#undef VK_STEP
  }
  __m256i s = _mm256_setzero_si256();
#define VK_SUM(i) s = _mm256_add_epi32(s, c##i);
  VK_ACC10(VK_SUM)
#undef VK_SUM
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), s);
  double total = 0;
  for (int32_t v : out) total += v;
  return total;
}

struct Kind {
  double (*run)(int64_t);
  double ops_per_iteration;
};

Kind kind_of(const std::string& name) {
  if (name == "fp32-avx512") return {fp32_avx512, 12.0 * 16 * 2};
  if (name == "fp32-avx2") return {fp32_avx2, 12.0 * 8 * 2};
  if (name == "bf16-avx512") return {bf16_avx512, 12.0 * 16 * 2 * 2};
  if (name == "int8-avx512") return {int8_avx512, 12.0 * 16 * 4 * 2};
  if (name == "int8-avxvnni") return {int8_avxvnni, 12.0 * 8 * 4 * 2};
  if (name == "int8-avx2") return {int8_avx2, 10.0 * 32 * 2};
  TORCH_CHECK(false, "peak_ops: unknown kind '", name, "' (fp32-avx512, fp32-avx2, bf16-avx512, int8-avx512, "
              "int8-avxvnni, int8-avx2)");
}

std::atomic<double> sink{0.0};  // the accumulators' sum goes somewhere, so the loops cannot be dropped

// Runs `iterations` rounds on every thread of torch's pool at once; returns the ops performed in all.
double peak_ops(const std::string& name, int64_t iterations) {
  TORCH_CHECK(iterations > 0, "peak_ops: iterations must be positive, got ", iterations);
  const Kind kind = kind_of(name);
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const double s = kind.run(iterations);
      double seen = sink.load();
      while (!sink.compare_exchange_weak(seen, seen + s)) {
      }
    }
  });
  return kind.ops_per_iteration * static_cast<double>(iterations) * static_cast<double>(threads);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vitkit, m) {
  m.def("peak_ops(str kind, int iterations) -> float", TORCH_FN(peak_ops));
}

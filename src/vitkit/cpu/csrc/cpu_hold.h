// Whether this CPU runs AVX-512 code with a feature, as vitkit's operators ask it. A library built with
// VITKIT_HOLD_AVX2 (vitkit.cpu.build does so under VITKIT_CPU_ISA=avx2) answers no on any CPU: on an AVX-512
// CPU it runs the paths of an AVX2-only one.
#pragma once

#if defined(VITKIT_HOLD_AVX2)
#define VITKIT_AVX512_HAS(feature) false
#else
#define VITKIT_AVX512_HAS(feature) __builtin_cpu_supports(feature)
#endif

"""What the CPU can do: its feature flags, read once from /proc/cpuinfo. The fast paths (vitkit.optimize's
int8 and bf16, the training loop's `precision="bf16-native"`) ask these before choosing a kernel."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux), read once; empty where that cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_vnni() -> bool:
    """Whether the CPU has VNNI: int8 dot products accumulated in int32."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_has_native_bf16() -> bool:
    """Whether the CPU computes bf16 dot products in hardware (AVX512-BF16 or AMX); without them oneDNN
    emulates bf16, at about a third of the fp32 speed."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})

"""What the CPU is and can do: its vendor and feature flags, read once from /proc/cpuinfo. The fast paths
(vitkit.optimize's int8 and bf16, the training loop's `precision="bf16-native"`, the engine of the linear
layers' training products) ask these before choosing a kernel; thread and worker counts ask `usable_cores`."""

from __future__ import annotations

import functools
import os


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The value of the first `name` line of /proc/cpuinfo (Linux), read once; "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo; empty where that cannot be read."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_isa() -> str:
    """The widest x86 vector extension the CPU has, "avx512" or "avx2"; "" for anything else. A hypervisor
    may give a Zen 3 (AVX2) and a Zen 4 (AVX-512) one model name, and their fastest kernels differ."""
    flags = cpu_flags()
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else ""


def cpu_vendor() -> str:
    """The CPU's vendor string ("GenuineIntel", "AuthenticAMD", ...); "" where /proc/cpuinfo cannot be
    read."""
    return _cpuinfo_field("vendor_id")


def cpu_has_vnni() -> bool:
    """Whether the CPU has VNNI: int8 dot products accumulated in int32."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_has_native_bf16() -> bool:
    """Whether the CPU computes bf16 dot products in hardware (AVX512-BF16 or AMX); without them oneDNN
    emulates bf16, at about a third of the fp32 speed."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R14 96-Core Processor"); "" where /proc/cpuinfo cannot be read."""
    return _cpuinfo_field("model name")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the system has one, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

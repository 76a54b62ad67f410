"""What the CPU is and can do: its vendor and feature flags, read once from /proc/cpuinfo. The fast paths
(vitkit.optimize's int8 and bf16, the training loop's `precision="bf16-native"`, the engine of the linear
layers' training products) ask these before choosing a kernel; thread and worker counts ask `usable_cores`.

`VITKIT_CPU_ISA=avx2` holds vitkit to AVX2 on an AVX-512 CPU: its flags lose every AVX-512 and AMX feature
and its compiled operators are built as for an AVX2 CPU (vitkit.cpu.build); it is read once per process.
With PyTorch's, oneDNN's, MKL's and inductor's code held too (`ISA_HOLD_ENV`), that runs an AVX2-only CPU's
fp32 paths: a proxy, whose core, caches and clocks stay this CPU's. (fbgemm's int8 kernels, OpenVINO and ONNX
Runtime choose by their own checks and are not held.)"""

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


HOLD_ENV = "VITKIT_CPU_ISA"
# The values HOLD_ENV takes: unset or empty (all the CPU has), or "avx2".
HOLDS = ("", "avx2")


# What holds each library of a process to AVX2: the proxy for an AVX2-only CPU (module docstring).
ISA_HOLD_ENV = {HOLD_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"}


def isa_hold() -> str:
    """"avx2" where HOLD_ENV holds vitkit to AVX2 (module docstring), "" where it is unset or empty; a
    ValueError naming the variable for any other value."""
    value = os.environ.get(HOLD_ENV, "").strip().lower()
    if value not in HOLDS:
        raise ValueError(f"{HOLD_ENV}={os.environ[HOLD_ENV]!r}: 'avx2' holds vitkit's kernels to AVX2, "
                         "unset uses all the CPU has")
    return value


def held_flags(flags: frozenset[str], hold: str) -> frozenset[str]:
    """`flags` as vitkit sees them under `hold`: under "avx2" without the AVX-512 and AMX features."""
    if hold == "avx2":
        return frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    return flags


@functools.cache
def process_hold() -> str:
    """This process's hold (`isa_hold`), read once: the CPU flags and the operators' builds agree on it."""
    return isa_hold()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo, as held by HOLD_ENV; empty where they cannot be read."""
    return held_flags(frozenset(_cpuinfo_field("flags").split()), process_hold())


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

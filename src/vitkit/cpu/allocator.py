"""The process's memory allocator, set for the large short-lived tensors of a ViT on the CPU.

glibc's malloc serves every request above its mmap threshold (128 KiB at start, raised as blocks are freed, to
at most 32 MiB) with a fresh `mmap`, and gives the block back to the kernel on `free`. A ViT allocates such
blocks at every layer (ViT-S/16 at batch 16: 19 MB for the MLP's hidden activations), so each new one is
faulted in again page by page and zeroed by the kernel before a kernel writes it: on 2 cores of an AMD EPYC
that was a quarter of the int8 ViT-S/16 time at batch 16 (docs/speed.md).

`retain_freed_memory()` asks glibc (`mallopt`) to serve large blocks from its heap and to keep freed memory
for reuse instead of returning it: what PyTorch's CPU performance guide gets from jemalloc or tcmalloc with
LD_PRELOAD, without a preload. It is process-wide and one-way: the process keeps its peak memory. `vitkit
bench` (for every contender alike), `vitkit eval` and `vitkit predict` call it; a Python program calls it once
at start. Training is left alone: on the Fashion-MNIST models it changed nothing beyond noise (2 threads).

`return_large_blocks()` is the opposite trade, for sharded training (`parallel=fsdp`), where memory is the
point: every block above 1 MiB gets an mmap of its own and goes back to the kernel when freed. FSDP gathers
each block's weights and reduce-scatters its gradients into buffers of tens of MB, and a small batch's
activations are blocks of 1-5 MB, all allocated and freed at every step; in glibc's heap they land between
tensors that outlive them and fragment it, so a process keeps memory it no longer uses. ViT-B/16 under FSDP
on 2 processes (benchmarks/bench_parallel.py, docs/training.md gives the figures) peaked at 1.51 GiB a
process with 1 MiB against 1.74 with 8 MiB and more with glibc's default, for a step 1.05-1.15x slower than
with 8 MiB (the kernel faults each mapping in afresh). The trainer calls it under FSDP on the CPU.

Where the C library is not glibc both do nothing and return False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Blocks above this are still mmapped and given back. Older glibc refuses thresholds above 32 MiB
# (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems); there the 32 MiB cap is taken instead.
MMAP_THRESHOLD = 1 << 30
MMAP_THRESHOLD_FALLBACK = 32 << 20
# Freed memory at the top of the heap beyond this is given back to the kernel.
TRIM_THRESHOLD = 1 << 30


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has `mallopt` and `gnu_get_libc_version`), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def glibc_version() -> str | None:
    """The running glibc's version ("2.36"), or None where the C library is not glibc."""
    libc = _glibc()
    return None if libc is None else libc.gnu_get_libc_version().decode()


def retain_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Serve blocks up to `mmap_threshold` bytes from the heap and keep up to `trim_threshold` bytes of freed
    memory for reuse (see the module docstring). Returns whether glibc took both settings."""
    libc = _glibc()
    if libc is None:
        return False
    ok_mmap = libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    if not ok_mmap and mmap_threshold > MMAP_THRESHOLD_FALLBACK:
        ok_mmap = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_FALLBACK) == 1
    ok_trim = libc.mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    return ok_mmap and ok_trim


# Blocks above this are mmapped and given back under `return_large_blocks`: FSDP's per-block buffers
# (ViT-B/16: 28 MB) and the activations of a batch of 2 at 224 px (1.2 MB a token-sized tensor) alike.
LARGE_BLOCK = 1 << 20


def return_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """Serve every block above `threshold` bytes with an mmap of its own and give it back to the kernel when
    freed, the threshold fixed (glibc otherwise raises it as blocks are freed): see the module docstring.
    Process-wide. Returns whether glibc took the setting."""
    libc = _glibc()
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
